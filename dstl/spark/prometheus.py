"""An optional Prometheus endpoint on the driver for the Spark operator (``prometheus_client``).

Theory of operation
-------------------
Off by default: ``DstlStatefulOperator(metrics_port=...)`` (or the Spark conf key
``spark.dstl.metrics.port``) starts one HTTP server on the driver, with its own
``CollectorRegistry`` (never the process-global one, so it does not mix with the user's
metrics). Nothing is pushed or polled: after each batch the operator hands the exporter a
:class:`MetricsSnapshot` — its cumulative totals, the last progress record, the checkpoint
coordinator's metrics and the metrics each executor agent sent with its task reports — and a
scrape renders the newest snapshot. The executors need no port of their own.

Names follow Flink's reporter where Flink has the metric: ``dstl_<group>_<name>`` with Flink's
group (``ChangelogStorage``, ``ChangelogMaterialization``, ``CheckpointCoordinator``) and leaf
(``numberOfUploadRequests``, ``uploadSizes``, ``completedMaterialization`` ...); counters are
exported as gauges holding the running total, as Flink's Prometheus reporter does. Every sample
carries ``operator``; agent metrics also ``agent`` (the agent's pid), one series per agent.

Histograms: each agent's histograms are already merged from samples over its storages
(:func:`dstl.metrics.merged_snapshot`); they are exported as a ``summary`` per agent
(``quantile`` 0.5 and 0.99, ``_count``) plus ``_mean`` and ``_max`` gauges. Quantiles of
different agents are never added or averaged: they are separate series (aggregate them in
PromQL with care, or use max).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dstl.errors import ConfigError

__all__ = ["MetricsSnapshot", "PrometheusExporter", "exposition"]

#: The five figures of an exported histogram (dstl.metrics.Histogram.summary).
_HIST_PARTS = ("count", "mean", "p50", "p99", "max")
#: DSTL's agent metric groups -> Flink's names of the same thing.
_RENAMES = {
    "materializer.lastDurationMs": "ChangelogMaterialization.lastDurationOfMaterialization",
    "materializer.started": "ChangelogMaterialization.startedMaterialization",
    "materializer.completed": "ChangelogMaterialization.completedMaterialization",
    "materializer.failed": "ChangelogMaterialization.failedMaterialization",
    "materializer.": "ChangelogMaterialization.",
    "cache.": "RestoreCache.",
    "requests": "Agent.requests",
    "connections": "Agent.connections",
}
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one scrape shows (replaced as a whole after each batch).

    Attributes:
        operator: the operator's name (the ``operator`` label).
        totals: cumulative figures of the operator since the driver started
            (``numRecordsIn``, ``numberOfCompletedBatches`` ...).
        last: figures of the last batch (``lastBatchId``, ``lastBatchDurationMs`` ...).
        coordinator: the checkpoint coordinator's metrics (``CheckpointCoordinator.*``).
        agents: agent pid -> that agent's metrics (``agent.*`` keys) from the last batch.
    """

    operator: str
    totals: Mapping[str, float] = field(default_factory=dict)
    last: Mapping[str, float] = field(default_factory=dict)
    coordinator: Mapping[str, float] = field(default_factory=dict)
    agents: Mapping[int, Mapping[str, float]] = field(default_factory=dict)


def metric_name(key: str) -> str:
    """``dstl_`` + the dotted DSTL/Flink name with every other character as ``_``."""
    return "dstl_" + _INVALID.sub("_", key.replace(".", "_"))


def _agent_key(key: str) -> str:
    """An agent's key without ``agent.``, with Flink's group where DSTL's differs."""
    key = key.removeprefix("agent.")
    for old, new in _RENAMES.items():
        if key == old or (old.endswith(".") and key.startswith(old)):
            return new + key[len(old):] if old.endswith(".") else new
    return key


def _split_histograms(values: Mapping[str, float]
                      ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Plain values and histograms (a base name with all five ``.count`` ... ``.max`` keys)."""
    bases = {k.rsplit(".", 1)[0] for k in values if k.rsplit(".", 1)[-1] in _HIST_PARTS}
    hists = {b: {p: values[f"{b}.{p}"] for p in _HIST_PARTS} for b in bases
             if all(f"{b}.{p}" in values for p in _HIST_PARTS)}
    taken = {f"{b}.{p}" for b in hists for p in _HIST_PARTS}
    return {k: v for k, v in values.items() if k not in taken}, hists


def _families(snap: MetricsSnapshot) -> Iterator[Any]:
    """The metric families of ``snap`` (prometheus_client ``Metric`` objects)."""
    from prometheus_client.core import GaugeMetricFamily, Metric

    gauges: dict[str, Any] = {}
    summaries: dict[str, Any] = {}

    def gauge(name: str, labels: dict[str, str], value: float) -> None:
        fam = gauges.get(name)
        if fam is None:
            fam = gauges[name] = GaugeMetricFamily(name, f"DSTL {name[5:]}",
                                                   labels=sorted(labels))
        fam.add_metric([labels[k] for k in sorted(labels)], float(value))

    def summary(name: str, labels: dict[str, str], h: Mapping[str, float]) -> None:
        fam = summaries.get(name)
        if fam is None:
            fam = summaries[name] = Metric(name, f"DSTL {name[5:]} (window of the last 1000)",
                                           "summary")
        for q, part in (("0.5", "p50"), ("0.99", "p99")):
            fam.add_sample(name, {**labels, "quantile": q}, float(h[part]))
        fam.add_sample(name + "_count", labels, float(h["count"]))
        gauge(name + "_mean", labels, h["mean"])
        gauge(name + "_max", labels, h["max"])

    op = {"operator": snap.operator}
    for source in (snap.totals, snap.last):
        for k, v in source.items():
            gauge(metric_name(f"operator.{k}"), op, v)
    plain, hists = _split_histograms(snap.coordinator)
    for k, v in plain.items():
        gauge(metric_name(k), op, v)
    for k, h in hists.items():
        summary(metric_name(k), op, h)
    for pid, values in sorted(snap.agents.items()):
        labels = {**op, "agent": str(pid)}
        plain, hists = _split_histograms({_agent_key(k): v for k, v in values.items()
                                          if k != "agent.pid"})
        for k, v in plain.items():
            gauge(metric_name(k), labels, v)
        for k, h in hists.items():
            summary(metric_name(k), labels, h)
    yield from gauges.values()
    yield from summaries.values()


class _Collector:
    """A prometheus_client collector over the newest snapshot."""

    def __init__(self, snap: MetricsSnapshot) -> None:
        self.snapshot = snap

    def collect(self) -> Iterable[Any]:
        return list(_families(self.snapshot))


def exposition(snap: MetricsSnapshot) -> str:
    """The text a scrape of ``snap`` returns (Prometheus text format 0.0.4)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snap))
    return generate_latest(registry).decode()


class PrometheusExporter:
    """The driver's HTTP endpoint (see the module docstring).

    Args:
        operator: the operator's name.
        port: TCP port (0: any free port; :attr:`port` tells which).
        host: the address to bind (default all interfaces: Prometheus scrapes from elsewhere).

    Raises:
        ConfigError: ``prometheus_client`` is not installed, or the port cannot be bound.
    """

    def __init__(self, operator: str, port: int, host: str = "0.0.0.0") -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as exc:
            raise ConfigError("metrics_port", port, "a port with prometheus_client installed",
                              owner="DstlStatefulOperator",
                              fix="pip install 'dstl[metrics]' (prometheus-client) on the "
                                  "driver, or leave metrics_port unset") from exc
        self._collector = _Collector(MetricsSnapshot(operator))
        self._lock = threading.Lock()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ConfigError("metrics_port", port, "a free TCP port on the driver",
                              owner="DstlStatefulOperator", fix=f"{exc}") from exc
        self.port = int(self._server.server_port)

    def update(self, snap: MetricsSnapshot) -> None:
        """Show ``snap`` from the next scrape on."""
        with self._lock:
            self._collector.snapshot = snap

    def close(self) -> None:
        """Stop the server and free the port. Idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
