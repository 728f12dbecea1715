"""What every Spark test session shares: the ``PYTHONPATH`` its Python workers need (the
folders of the test modules that define processors: cloudpickle ships a class by reference, so a
worker imports its module, then whatever ``PYTHONPATH`` already holds), the conf every session
sets, and its start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent


def worker_pythonpath() -> str:
    """``tests/integration/spark``, ``tests``, then the current ``PYTHONPATH``."""
    paths = [str(TESTS / "integration" / "spark"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


#: no UI and no progress bar, a 1 GiB driver, 4 shuffle partitions, Arrow for pandas; a Python
#: worker that starts slowly on a loaded machine (it imports pyspark, pyarrow and dstl) may take
#: longer than the 15 s default to connect back ("Python worker failed to connect back"); and
#: JVMs that compile with C1 only: a test's JVM lives seconds to minutes, and C2's compilations
#: cost more CPU than they save there (two Spark test modules: 100-108 s -> 94-97 s)
SESSION_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "1g",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.authenticate.socketTimeout": "120s",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
    "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1",
}


def start_session(builder: Any, conf: dict[str, str]) -> Any:
    """``builder`` with :data:`SESSION_CONF`, then ``conf`` over it; Spark's log at ERROR."""
    for k, v in (SESSION_CONF | conf).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
