"""The task's DSTL version check and how the driver reads a failed job."""

from __future__ import annotations

import pytest

import dstl
from dstl.errors import UsageError
from dstl.spark.batch_job import deployment_problem
from dstl.spark.task import check_version


def test_same_or_unset_version_passes_and_another_fails() -> None:
    check_version(dstl.__version__)
    check_version("")
    with pytest.raises(UsageError, match=r"DSTL version mismatch: the driver runs DSTL 9\.9"):
        check_version("9.9")


def test_driver_recognises_deployment_problems_in_job_errors() -> None:
    job = ("py4j.protocol.Py4JJavaError: ...\n  File \"task.py\", line 3\n"
           "dstl.errors.UsageError: DSTL version mismatch: the driver runs DSTL 1, ...\n")
    found = deployment_problem(job)
    assert found is not None and found.startswith("DSTL version mismatch: the driver runs DSTL 1")
    missing = deployment_problem("ModuleNotFoundError: No module named 'dstl'")
    assert missing is not None and "PYSPARK_PYTHON" in missing
    assert deployment_problem("ValueError: processor refused the poison key") is None
