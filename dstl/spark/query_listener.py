"""The driver's ``StreamingQueryListener`` of :meth:`DstlStatefulOperator.transform`: each batch
Spark reports (after its commit log entry) has its DSTL checkpoint written
(:meth:`~dstl.spark.DstlStatefulOperator.on_batch_committed`)."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

from pyspark.sql.streaming.listener import StreamingQueryListener

__all__ = ["BatchListener", "CommitsBatches"]

logger = logging.getLogger(__name__)


class CommitsBatches(Protocol):
    """What the listener needs of the operator (:class:`~dstl.spark.DstlStatefulOperator`)."""

    name: str

    def on_batch_committed(self, batch_id: int, query_id: str,
                           duration_ms: float = 0.0) -> None:
        """Spark committed micro-batch ``batch_id`` of query ``query_id``."""


class BatchListener(StreamingQueryListener):
    """Commits the operator's checkpoint of every batch Spark reports. Holds the operator
    weakly: a dropped operator leaves a listener that does nothing."""

    def __init__(self, operator: CommitsBatches) -> None:
        self._operator = weakref.ref(operator)

    def onQueryStarted(self, event: Any) -> None:
        pass  # nothing to do before the first batch: the operator started when it planned

    def onQueryProgress(self, event: Any) -> None:
        op = self._operator()
        if op is None:
            return
        progress = event.progress
        try:
            op.on_batch_committed(int(progress.batchId), str(progress.id),
                                  float(progress.batchDuration or 0.0))
        except Exception:
            logger.exception("operator %s: the checkpoint of batch %s was not written now; "
                             "the next batch's report or the next start of the operator "
                             "writes it", op.name, progress.batchId)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass
