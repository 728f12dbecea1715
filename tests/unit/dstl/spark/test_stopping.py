"""How the operator tells a batch interrupted by ``query.stop()`` from a failure, and the short
error it raises then (:mod:`dstl.spark.stopping`); the real stop is in
``tests/integration/spark/test_spark_stop.py``."""

from __future__ import annotations

from typing import Any

import pytest

from dstl.errors import BatchInterruptedError
from dstl.spark.stopping import INTERRUPTION_EXCEPTIONS, PROXY_ERROR_PREFIX, stop_interruption


class _FakeContext:
    def __init__(self, group: str | None, interrupted: bool) -> None:
        self.group = group
        self._jvm = _FakeJvm(interrupted)

    def getLocalProperty(self, key: str) -> str | None:
        return self.group if key == "spark.jobGroup.id" else None


class _FakeJvm:
    def __init__(self, interrupted: bool) -> None:
        outer = self

        class _Thread:
            @staticmethod
            def currentThread() -> Any:
                return outer

        self.java = type("java", (), {"lang": type("lang", (), {"Thread": _Thread})})
        self.interrupted = interrupted

    def isInterrupted(self) -> bool:
        return self.interrupted


class _FakeSession:
    def __init__(self, group: str | None = None, interrupted: bool = False) -> None:
        self.sparkContext = _FakeContext(group, interrupted)


_JAVA_STACK = "".join(f"\tat org.example.Frame{i}.call(Frame.java:{i})\n" for i in range(200))


@pytest.mark.parametrize("name", INTERRUPTION_EXCEPTIONS)
def test_an_interrupted_call_becomes_a_short_interruption(name: str) -> None:
    cause = RuntimeError(f"An error occurred while calling o240.getResult.\n: {name}\n"
                         + _JAVA_STACK)
    try:
        raise ValueError("wrapped") from cause
    except ValueError as exc:
        err = stop_interruption(exc, "op", 7, _FakeSession())
    assert isinstance(err, BatchInterruptedError)
    assert err.operator == "op" and err.batch_id == 7
    text = str(err)
    # what Spark's PROXY_ERROR needs: the literal, then the class name, and nothing long after
    start = text.index(PROXY_ERROR_PREFIX)
    assert text.endswith(name) and len(text) - start < 200, text
    assert "o240.getResult" in text


def test_a_cancelled_job_group_of_this_query_is_a_stop() -> None:
    run_id = "6ee9661a-d87f-48c7-afc0-eed652a5409e"
    exc = RuntimeError(f"[SPARK_JOB_CANCELLED] Job 3 cancelled Query [id = x, runId = {run_id}] "
                       "was stopped")
    err = stop_interruption(exc, "op", 1, _FakeSession(group=run_id))
    assert err is not None and str(err).endswith(INTERRUPTION_EXCEPTIONS[0] + ")")
    # another group's cancellation, or none: a failure, raised unchanged
    assert stop_interruption(exc, "op", 1, _FakeSession(group="other")) is None
    assert stop_interruption(exc, "op", 1, _FakeSession()) is None


def test_an_interrupted_thread_is_a_stop_and_other_errors_are_not() -> None:
    exc = OSError("connection reset")
    assert stop_interruption(exc, "op", 1, _FakeSession(interrupted=False)) is None
    err = stop_interruption(exc, "op", 1, _FakeSession(interrupted=True))
    assert err is not None and PROXY_ERROR_PREFIX in str(err)


def test_a_session_that_cannot_answer_is_not_a_stop() -> None:
    class Broken:
        @property
        def sparkContext(self) -> Any:
            from py4j.protocol import Py4JError

            raise Py4JError("gateway gone")

    assert stop_interruption(KeyError("x"), "op", 1, Broken()) is None


def test_the_message_fits_sparks_stop_pattern_and_a_long_one_would_not() -> None:
    """Spark's pattern (StreamExecution.PROXY_ERROR) matches our message; the text after its
    literal is what java.util.regex recurses over: ours is short, the raw error's is not."""
    import re

    pattern = re.compile(PROXY_ERROR_PREFIX + r"((.|\r\n|\r|\n)*)(" + "|".join(
        re.escape(n) for n in INTERRUPTION_EXCEPTIONS) + ")")
    raw = (f"{PROXY_ERROR_PREFIX} o240.getResult.\n: {INTERRUPTION_EXCEPTIONS[0]}\n"
           + _JAVA_STACK)
    err = stop_interruption(RuntimeError(raw.split(": ", 1)[1]), "op", 3, _FakeSession())
    assert err is not None
    m = pattern.search(str(err))
    assert m is not None and len(str(err)) - m.start() < 200
    assert len(raw) - raw.index(PROXY_ERROR_PREFIX) > 5000  # what overflowed the JVM's stack


def test_without_a_session_only_the_text_counts() -> None:
    assert stop_interruption(KeyError("x"), "op", 1, None) is None
    err = stop_interruption(RuntimeError("... java.io.InterruptedIOException ..."), "op", 1, None)
    assert err is not None and str(err).endswith("java.io.InterruptedIOException")
