"""Metrics: counters, gauges and windowed histograms, exported as one flat dict.

Names follow Flink's ``ChangelogStorage.*`` metric group where an equivalent exists (reference §6),
so a Flink operator recognises them; DSTL-only metrics use the same style. Histograms keep the last
1000 samples (Flink's ``DescriptiveStatisticsHistogram`` window) and export ``.count``, ``.mean``,
``.p50``, ``.p99``, ``.max``. Thread-safe; cheap enough for per-upload (not per-change) updates.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Counter", "Histogram", "MetricsRegistry", "merged_snapshot"]

_WINDOW = 1000


class Counter:
    """A monotonically increasing number."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._lock = threading.Lock()

    def inc(self, n: float = 1.0) -> None:
        with self._lock:
            self.value += n


class Histogram:
    """The last ``window`` samples and the total count."""

    __slots__ = ("_lock", "_samples", "count")

    def __init__(self, window: int = _WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.count = 0
        self._lock = threading.Lock()

    def update(self, value: float) -> None:
        with self._lock:
            self._samples.append(value)
            self.count += 1

    def state(self) -> tuple[list[float], int]:
        """The window's samples and the total count (for merging histograms)."""
        with self._lock:
            return list(self._samples), self.count

    def summary(self) -> dict[str, float]:
        xs, count = self.state()
        return _summary(sorted(xs), count)


def _summary(xs: list[float], count: int) -> dict[str, float]:
    """The exported figures of sorted samples ``xs`` (``count``: all samples ever)."""
    if not xs:
        return {"count": float(count), "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]

    return {"count": float(count), "mean": sum(xs) / len(xs), "p50": pct(0.50),
            "p99": pct(0.99), "max": xs[-1]}


class MetricsRegistry:
    """Named metrics of one component; :meth:`snapshot` flattens them into ``{name: value}``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._counters: dict[str, Counter] = {}
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        self._lock = threading.Lock()

    def counter(self, name: str) -> Counter:
        with self._lock:
            return self._counters.setdefault(name, Counter())

    def histogram(self, name: str) -> Histogram:
        with self._lock:
            return self._histograms.setdefault(name, Histogram())

    def gauge(self, name: str, fn: Callable[[], float]) -> None:
        with self._lock:
            self._gauges[name] = fn

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            counters = dict(self._counters)
            hists = dict(self._histograms)
            gauges = dict(self._gauges)
        out: dict[str, float] = {}
        p = self.prefix
        for name, c in counters.items():
            out[f"{p}{name}"] = c.value
        for name, h in hists.items():
            for k, v in h.summary().items():
                out[f"{p}{name}.{k}"] = v
        for name, fn in gauges.items():
            out[f"{p}{name}"] = float(fn())
        return out

    def parts(self) -> tuple[dict[str, float], dict[str, Histogram]]:
        """Counters and gauges as values, and the histograms themselves (by full name)."""
        with self._lock:
            counters = dict(self._counters)
            hists = dict(self._histograms)
            gauges = dict(self._gauges)
        p = self.prefix
        values = {f"{p}{n}": c.value for n, c in counters.items()}
        values.update({f"{p}{n}": float(fn()) for n, fn in gauges.items()})
        return values, {f"{p}{n}": h for n, h in hists.items()}


def merged_snapshot(registries: list[MetricsRegistry]) -> dict[str, float]:
    """The :meth:`MetricsRegistry.snapshot` of several registries as one: counters and gauges
    summed, histograms merged from their samples (a percentile or mean of several histograms is
    not the sum, nor the mean, of theirs; the max is the max)."""
    out: dict[str, float] = {}
    merged: dict[str, tuple[list[float], int]] = {}
    for reg in registries:
        values, hists = reg.parts()
        for k, v in values.items():
            out[k] = out.get(k, 0.0) + v
        for name, h in hists.items():
            xs, count = h.state()
            acc = merged.setdefault(name, ([], 0))
            merged[name] = (acc[0] + xs, acc[1] + count)
    for name, (xs, count) in merged.items():
        for k, v in _summary(sorted(xs), count).items():
            out[f"{name}.{k}"] = v
    return out
