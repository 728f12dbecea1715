"""What a Python worker and the executor agent import: not the driver's side of the operator
(its coordinator, manifests and metrics endpoint), nor fsspec for a store that does not need it
(its entry-point scan reads every zip on the worker's path: pyspark.zip, py4j), which the first
batch after a restart would wait for in every worker and in the agent's start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dstl.spark

_DRIVER_ONLY = ("dstl.spark.operator", "dstl.checkpoint.coordinator", "dstl.spark.prometheus",
                "pandas", "fsspec")


@pytest.mark.parametrize(("module", "left_out"), [
    ("dstl.spark.task", _DRIVER_ONLY), ("dstl.spark.warmup", _DRIVER_ONLY),
    ("dstl.spark.agent.__main__", _DRIVER_ONLY),
    # the task body inside the user's query reads manifests (dstl.checkpoint) itself
    ("dstl.spark.query", ("dstl.spark.operator", "dstl.spark.prometheus", "pandas", "fsspec"))])
def test_worker_and_agent_imports_leave_the_driver_side_out(module: str,
                                                            left_out: tuple[str, ...]) -> None:
    code = (f"import sys, {module}\n"
            f"print(','.join(m for m in {left_out!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"


def test_the_public_names_still_resolve() -> None:
    from dstl.spark import DstlStatefulOperator, register, with_heartbeat
    from dstl.spark.heartbeat import with_heartbeat as wh
    from dstl.spark.operator import DstlStatefulOperator as Op

    assert DstlStatefulOperator is Op and with_heartbeat is wh and callable(register)
    assert set(dstl.spark.__all__) <= set(dir(dstl.spark)) | {"DstlStatefulOperator",
                                                            "register", "with_heartbeat"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dstl.spark.nope  # noqa: B018


def test_a_local_store_opens_without_fsspec_and_a_memory_store_with_it(tmp_path) -> None:
    code = ("import sys\n"
            "from dstl.stores import open_store\n"
            f"open_store({str(tmp_path)!r}).close()\n"
            "print('fsspec' in sys.modules)\n"
            "open_store('memory://bucket/app').close()\n"
            "print('fsspec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["False", "True"]
