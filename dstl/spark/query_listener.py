"""The driver's ``StreamingQueryListener`` of :meth:`DstlStatefulOperator.transform`: each batch
Spark reports (after its commit log entry) has its DSTL checkpoint written
(:meth:`~dstl.spark.DstlStatefulOperator.on_batch_committed`)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

__all__ = ["BatchListener"]

logger = logging.getLogger(__name__)


class BatchListener(StreamingQueryListener):
    """Commits the operator's checkpoint of every batch Spark reports. Holds the operator
    weakly: a dropped operator leaves a listener that does nothing."""

    def __init__(self, operator: Any) -> None:
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
