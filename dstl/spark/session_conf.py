"""The Spark session as the operator reads it: ``spark.dstl.*`` settings, backend options, time zone.

The operator reads its settings once, when it gets ready: the SparkContext's ``spark.dstl.*``
(:func:`static_conf`) and the session's (:func:`dstl_runtime_conf`); the backend options come
from ``spark.dstl.backend.*`` (:func:`backend_options_from`) with the operator's one
materialization interval (:func:`with_interval`). Every batch checks that the settings are still
the ones it started with (:func:`check_conf_unchanged`): the executors keep what they started
with. Reads are by name, a few py4j calls each (the whole conf costs round trips per key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from dstl.errors import ConfigError
from materializer.options import BackendOptions

__all__ = ["INTERVAL_KEY", "METRICS_HOST_KEY", "METRICS_PORT_KEY", "backend_options_from",
           "check_conf_unchanged", "dstl_keys", "dstl_runtime_conf", "is_connect",
           "runtime_conf", "same_jvm_session", "session_time_zone", "static_conf",
           "with_interval"]

INTERVAL_KEY = "spark.dstl.backend.materialization_interval_s"
METRICS_PORT_KEY = "spark.dstl.metrics.port"
METRICS_HOST_KEY = "spark.dstl.metrics.host"


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect client session (no SparkContext, no JVM here)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


#: the SparkContext settings DSTL reads besides ``spark.dstl.*``
_STATIC_KEYS = ("spark.python.daemon.module",)


def static_conf(spark: Any) -> dict[str, str]:
    """The SparkContext's ``spark.dstl.*`` settings and :data:`_STATIC_KEYS`; a Spark Connect
    client reads what the server's session shows of them (``spark.conf``). Read by name: the
    whole conf costs two or three py4j round trips per key, at every query start."""
    if is_connect(spark):
        return {str(k): str(v) for k, v in spark.conf.getAll.items()
                if str(k).startswith("spark.dstl.") or str(k) in _STATIC_KEYS}
    jconf = spark.sparkContext._jsc.sc().conf()
    out = {f"spark.dstl.{t._1()}": str(t._2()) for t in jconf.getAllWithPrefix("spark.dstl.")}
    for k in _STATIC_KEYS:
        v = jconf.get(k, None)
        if v is not None:
            out[k] = str(v)
    return out


def runtime_conf(spark: Any) -> dict[str, str]:
    """The session's runtime conf (``spark.conf``: what ``spark.conf.set`` changed)."""
    return {str(k): str(v) for k, v in spark.conf.getAll.items()}


def dstl_runtime_conf(spark: Any) -> dict[str, str]:
    """The session's runtime ``spark.dstl.*`` settings, read every batch: the key names in one
    py4j call (the Java map's key set as text: Spark's conf keys hold no ``", "``), then one
    call per ``spark.dstl.*`` key. ``spark.conf.getAll`` costs two or three round trips per key
    of the whole conf (it iterates a Java map from Python): the largest driver cost of a steady
    batch in ``bench/tws.py``'s profile (py-spy)."""
    jconf = getattr(spark.conf, "_jconf", None)
    if jconf is None:  # not a classic session: the general read
        return dstl_keys(runtime_conf(spark))
    names = str(jconf.getAllAsJava().keySet().toString())[1:-1].split(", ")
    out = {}
    for k in names:
        if k.startswith("spark.dstl."):
            v = jconf.get(k, None)
            if v is not None:
                out[k] = str(v)
    return out


def dstl_keys(conf: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in conf.items() if k.startswith("spark.dstl.")}


def same_jvm_session(a: Any, b: Any) -> bool:
    """Whether two Python session objects wrap the same JVM session (a batch's DataFrame often
    hands out a new wrapper of the user's session)."""
    ja, jb = getattr(a, "_jsparkSession", None), getattr(b, "_jsparkSession", None)
    return ja is not None and jb is not None and bool(ja.equals(jb))


def check_conf_unchanged(name: str, started: Mapping[str, str], static: Mapping[str, str],
                         session: Any, batch_id: int) -> None:
    """Refuse to run a batch under ``spark.dstl.*`` settings other than those the operator
    started with: they are read once (the executors' workers and agent keep the options they
    started with), so a change made with ``spark.conf.set`` after the first batch would otherwise
    be ignored. Looks at the batch's session (under Structured Streaming a clone of the user's,
    taken when the query started) and at the user's session (where ``spark.conf.set`` lands).

    Raises:
        ConfigError: naming the changed key(s), the value in effect and the fix.
    """
    from pyspark.sql import SparkSession

    sessions = [session]
    default = getattr(SparkSession, "_instantiatedSession", None)
    if default is not None and default is not session and not same_jvm_session(default,
                                                                                session):
        sessions.append(default)  # each read: 2 py4j round trips + 1 per spark.dstl.* key
    for s in sessions:
        now = {**static, **dstl_runtime_conf(s)}
        changed = sorted(k for k in now.keys() | started.keys()
                         if now.get(k) != started.get(k))
        if changed:
            key = changed[0]
            raise ConfigError(key, now.get(key, "<unset>"), "the value the operator started "
                              f"with ({started.get(key, '<unset>')!r})", owner="spark conf",
                              fix=f"operator {name!r} (batch {batch_id}): spark.dstl.* settings "
                                  "are read once, at the first batch, and the executors keep "
                                  "them; changed since: " + ", ".join(changed) + ". Set them "
                                  "back (spark.conf.set / unset), or stop the query and start "
                                  "a new Spark application with the new values")


def with_interval(explicit: BackendOptions | None, conf: Mapping[str, str],
                   interval: float | None) -> BackendOptions:
    """The operator's backend options (``explicit``, else from ``conf``) with the operator's
    ``materialization_interval_s`` — the interval's one setting under Spark.

    Raises:
        ConfigError: the interval is also set there (a non-default ``backend_options`` value, or
            the conf key) to another value.
    """
    opts = explicit or backend_options_from(conf)
    given = opts.materialization_interval_s
    set_there = (given != BackendOptions().materialization_interval_s if explicit is not None
                 else INTERVAL_KEY in conf)
    if set_there and given != interval:
        raise ConfigError("materialization_interval_s", given,
                          f"the operator's materialization_interval_s ({interval!r}), which is "
                          "the interval of its backends: set it there only",
                          owner="DstlStatefulOperator.backend_options" if explicit is not None
                          else "spark.dstl.backend")
    return opts.replace(materialization_interval_s=interval)


def backend_options_from(conf: Mapping[str, str]) -> BackendOptions:
    prefix = "spark.dstl.backend."
    known = {f.name: f for f in fields(BackendOptions)}
    kwargs: dict[str, Any] = {}
    for k, raw in conf.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if name not in known:
            raise ConfigError(name, raw, f"one of {sorted(known)}", owner="spark.dstl.backend")
        default = getattr(BackendOptions(), name)
        try:
            if isinstance(default, str):
                kwargs[name] = raw   # a choice (lmdb_snapshot_format): BackendOptions checks it
            elif raw.lower() in ("none", ""):
                kwargs[name] = None
            elif isinstance(default, int) and not isinstance(default, bool):
                kwargs[name] = int(raw)
            else:
                kwargs[name] = float(raw)
        except ValueError as exc:
            raise ConfigError(name, raw, "a number or 'none'", owner="spark.dstl.backend") from exc
    return BackendOptions(**kwargs)


def session_time_zone(spark: Any) -> str:
    """The session's time zone (``spark.sql.session.timeZone``; the JVM's default when unset)."""
    from dstl.spark.outputs import time_zone

    tz = spark.conf.get("spark.sql.session.timeZone", None)
    name = str(tz) if tz else "UTC"
    time_zone(name)  # an id Python cannot read fails here, before any batch runs
    return name
