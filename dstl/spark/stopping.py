"""What a streaming query's ``stop()`` does to a batch the operator is running, and the error the
operator raises then (:func:`stop_interruption`).

Theory of operation
-------------------
``query.stop()`` on a micro-batch query sets the query's state to stopped, cancels the jobs of
its job group (the query's run id) and interrupts the query's thread. Under PySpark that thread
is inside the Python ``foreachBatch`` callback, and every JVM call the callback makes runs on it
(py4j's pinned threads). So the batch ends in one of three ways, depending on where it is:

* a JVM call that waits (collecting the tasks' results, a sink's job) fails with
  ``java.lang.InterruptedException`` (or an ``InterruptedIOException`` /
  ``ClosedByInterruptException``), which reaches Python as a ``Py4JJavaError`` carrying the whole
  Java stack trace;
* the job fails first, with a ``SparkException`` saying the job group was cancelled;
* the callback is in Python code: it runs on, and its next JVM call that waits is interrupted.

Spark then has to tell a stop from a failure. For an error from a Python ``foreachBatch`` it
has only the text of the Python traceback, which py4j hands back as the message of a
``Py4JException``; it matches it against ``StreamExecution.PROXY_ERROR``: the literal
``py4j.protocol.Py4JJavaError: An error occurred while calling``, then
``((.|\\r\\n|\\r|\\n)*)``, then the name of an interruption exception. ``java.util.regex``
matches that repeated group by recursion, several stack frames per character, and the greedy
group first runs to the end of the text: a traceback that carries a Java stack trace after
the literal (5-10 KB) overflows the stack of the query's thread. That is the
``StackOverflowError`` logged ("Exception in thread "stream execution thread ..."") when a query
was stopped during a batch: the thread died in its error handler instead of ending the query
cleanly.

So the operator catches what a stop does to a batch and raises, with its context suppressed, a
:class:`~dstl.errors.BatchInterruptedError` whose message ends with the interrupted call in the
form Spark looks for and nothing long after it. Spark then ends the query as stopped (no error,
``query.exception()`` is ``None``), and the regex runs over a few dozen characters. Any other
error propagates unchanged. The batch's checkpoint, if it was triggered and not completed, is
aborted as for any failed batch; Spark's commit log does not have the batch, so the next start
runs it again from the checkpoint before it.

A stop is recognised by what it leaves: an interruption exception named in the error or its
chain; a job-group cancellation of this query's group; or the query's thread still flagged as
interrupted (asked through py4j, which runs the call on that thread).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from dstl.errors import BatchInterruptedError

__all__ = ["INTERRUPTION_EXCEPTIONS", "PROXY_ERROR_PREFIX", "stop_interruption"]

logger = logging.getLogger(__name__)

#: The Java exceptions Spark takes as "interrupted" (``StreamExecution.IO_EXCEPTION_NAMES``).
INTERRUPTION_EXCEPTIONS = ("java.lang.InterruptedException", "java.io.InterruptedIOException",
                           "java.nio.channels.ClosedByInterruptException")
#: The literal that starts Spark's ``PROXY_ERROR`` pattern.
PROXY_ERROR_PREFIX = "py4j.protocol.Py4JJavaError: An error occurred while calling"
#: How much of each error in a chain is searched (a Java stack trace is a few KB).
_TEXT_LIMIT = 64 * 1024
_CALL_RE = re.compile(r"An error occurred while calling ([\w.$]+?)\.?\s*\n")


def stop_interruption(exc: BaseException, operator: str, batch_id: int,
                      spark: Any) -> BatchInterruptedError | None:
    """The error to raise instead of ``exc`` when ``exc`` is what the query's stop did to the
    batch (see the module docstring); ``None``: ``exc`` is a failure, raise it unchanged.
    ``spark``: the batch's session (``None``: only the error's text is looked at)."""
    text = _chain_text(exc)
    found = next((name for name in INTERRUPTION_EXCEPTIONS if name in text), None)
    if found is None and spark is None:
        return None
    if found is None:
        if _own_job_group_cancelled(text, spark):
            found = "job group cancelled by the query's stop"
        elif _thread_interrupted(spark):
            found = "the query's thread was interrupted by its stop"
        else:
            return None
    m = _CALL_RE.search(text)
    call = m.group(1) if m else "foreachBatch"
    # the form StreamExecution.PROXY_ERROR matches, with the class name Spark looks for last
    tail = found if found in INTERRUPTION_EXCEPTIONS else \
        f"{found} ({INTERRUPTION_EXCEPTIONS[0]})"
    logger.info("operator %s, batch %d: interrupted by the query's stop (%s: %s)", operator,
                batch_id, type(exc).__name__, _first_line(exc))
    logger.debug("operator %s, batch %d: the interrupted call's error", operator, batch_id,
                 exc_info=exc)
    return BatchInterruptedError(operator, batch_id, f"{PROXY_ERROR_PREFIX} {call}: {tail}")


def _chain_text(exc: BaseException) -> str:
    """The text of ``exc`` and of the errors it was raised from or during."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(parts) < 16:
        seen.add(id(cur))
        parts.append(f"{type(cur).__module__}.{type(cur).__name__}: {_str(cur)[:_TEXT_LIMIT]}")
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


def _str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as err:  # noqa: BLE001 - a py4j error whose JVM is gone may not print
        return f"<{type(exc).__name__}: str() failed: {err!r}>"


def _first_line(exc: BaseException) -> str:
    lines = _str(exc).strip().splitlines()
    return " ".join(lines[:2])[:300] if lines else ""


def _own_job_group_cancelled(text: str, spark: Any) -> bool:
    """Whether ``text`` reports this query's job group cancelled (Spark's own test of a
    ``SparkException``: "cancelled" and the group's id, which is the query's run id)."""
    if "cancelled" not in text:
        return False
    group = _local_property(spark, "spark.jobGroup.id")
    return group is not None and group != "" and group in text


def _local_property(spark: Any, key: str) -> str | None:
    from py4j.protocol import Py4JError

    try:
        value = spark.sparkContext.getLocalProperty(key)
    except Py4JError as err:  # the session is stopping too: nothing to ask
        logger.debug("cannot read local property %s: %r", key, err)
        return None
    return str(value) if value is not None else None


def _thread_interrupted(spark: Any) -> bool:
    """Whether the JVM thread running this callback (py4j's pinned thread: the query's) has its
    interrupt flag set; ``isInterrupted`` leaves the flag as it is."""
    from py4j.protocol import Py4JError

    try:
        jvm = spark.sparkContext._jvm
        return bool(jvm.java.lang.Thread.currentThread().isInterrupted())
    except Py4JError as err:  # the gateway is going away: not a stop we can prove
        logger.debug("cannot ask the JVM thread's interrupt flag: %r", err)
        return False
