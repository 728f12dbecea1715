"""What the driver ships to every task of the Spark operator: the operator's configuration
(:class:`OperatorConfig`, fixed for the query) and the micro-batch's input (:class:`TaskInput`),
plus the per-partition names and options derived from them.

Both are plain frozen dataclasses: they travel to the executors inside the ``mapInArrow``
closure (cloudpickle), and every module of the executor side reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dstl.checks import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_mapping,
    check_optional_path,
    check_str,
)
from dstl.errors import ConfigTypeError
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange
from dstl.options import DstlOptions
from dstl.spark.timing import TIME_MODES
from materializer.options import BackendOptions

__all__ = ["OperatorConfig", "TaskInput", "processor_id"]


@dataclass(frozen=True)
class OperatorConfig:
    """Everything a task needs to know about the operator (shipped with the task closure)."""

    name: str
    processor: Any  # the StatefulProcessor class (cloudpickled)
    key_column: str
    output_columns: tuple[str, ...]
    arrow_schema: Any  # pyarrow schema of the output columns + the report column
    state_uri: str
    storage_options: dict[str, Any] | None
    partitions: int
    max_parallelism: int
    table: str
    dstl_options: DstlOptions
    backend_options: BackendOptions  # its materialization_interval_s is the operator's
    local_dir: str | None = None
    agent: bool = True
    time_mode: str = "none"  # one of dstl.spark.timing.TIME_MODES
    #: the Spark session's time zone: naive datetimes in timestamp outputs are in it
    session_time_zone: str = "UTC"
    #: names the processor's code (module, name and a digest of its pickled class, made once
    #: on the driver; :func:`processor_id`): the class itself may arrive as a new, equal
    #: object with every task, so workers compare this instead ("": the class's name only)
    processor_id: str = ""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def agent_materializes(self) -> bool:
        """The executor agent materializes LMDB partitions (a heap lives in one worker's
        memory, so the task materializes it)."""
        return self.agent and self.table == "lmdb"

    @property
    def table_backend_options(self) -> BackendOptions:
        """The options of the partitions' backends: with the agent materializing, a backend
        does not remember its changed entries (the agent reads them from the change sets it
        uploads, :mod:`dstl.spark.agent.materializer`)."""
        o = self.backend_options
        if self.agent_materializes and o.incremental_snapshots:
            return o.replace(incremental_snapshots=False)
        return o

    def key_groups(self, partition: int) -> KeyGroupRange:
        """The key groups of ``partition`` (Flink's operator-index rule)."""
        return KeyGroupRange.of_operator(self.max_parallelism, self.partitions, partition)

    def operator_id(self, partition: int) -> str:
        """The backend's operator id (log id) of ``partition``."""
        return f"{self.name}/p{partition}"


def processor_id(processor: type) -> str:
    """``module.qualname:digest`` of a processor class: the digest is of the class as
    cloudpickle ships it (by reference for an importable class, by value with its code for one
    defined in ``__main__`` or a notebook), so a redefined class of the same name differs."""
    import hashlib

    from pyspark import cloudpickle

    pickled: bytes = cloudpickle.dumps(processor)  # type: ignore[no-untyped-call]
    digest = hashlib.sha256(pickled).hexdigest()[:16]
    return f"{processor.__module__}.{processor.__qualname__}:{digest}"


def _check(c: OperatorConfig) -> None:
    """The fields' types and ranges (one place). ``DstlStatefulOperator`` checked the user's
    arguments already with the same rules; this keeps a config built by hand (tests, tools)
    from reaching the executors malformed."""
    owner = "OperatorConfig"
    check_str(c.name, "name", owner, forbidden="/")
    if not isinstance(c.processor, type):
        raise ConfigTypeError("processor", c.processor, "a StatefulProcessor subclass",
                              owner=owner)
    check_str(c.key_column, "key_column", owner, forbidden="`")
    if not isinstance(c.output_columns, tuple) or not all(
            isinstance(n, str) for n in c.output_columns):
        raise ConfigTypeError("output_columns", c.output_columns, "a tuple of column names",
                              owner=owner)
    check_str(c.state_uri, "state_uri", owner)
    check_mapping(c.storage_options, "storage_options", owner)
    check_int(c.max_parallelism, "max_parallelism", owner, lo=1, hi=MAX_PARALLELISM_LIMIT)
    check_int(c.partitions, "partitions", owner, lo=1, hi=c.max_parallelism)
    check_choice(c.table, "table", owner, ("lmdb", "heap"))
    check_instance(c.dstl_options, "dstl_options", owner, DstlOptions)
    check_instance(c.backend_options, "backend_options", owner, BackendOptions)
    check_optional_path(c.local_dir, "local_dir", owner)
    check_bool(c.agent, "agent", owner)
    check_choice(c.time_mode, "time_mode", owner, TIME_MODES)
    check_str(c.session_time_zone, "session_time_zone", owner)
    if not isinstance(c.processor_id, str):
        raise ConfigTypeError("processor_id", c.processor_id, "a string", owner=owner)


@dataclass(frozen=True)
class TaskInput:
    """What changes per micro-batch.

    Attributes:
        batch_id: the micro-batch, also the checkpoint id the task writes.
        base_checkpoint: the checkpoint the batch starts from (-1: empty state).
        base_handles: partition -> the base checkpoint's backend handle (JSON) of that
            partition.
        retained: the checkpoint ids the coordinator still retains.
        processing_time_ms: the batch's processing time (epoch ms; the driver's clock at the
            batch's start; ``-1``: unknown).
        watermark_ms: the batch's watermark (epoch ms; ``-1``: no watermark configured).
        driver_version: the driver's DSTL version; a task whose own differs fails at once
            (``""``: not checked).
    """

    batch_id: int
    base_checkpoint: int
    base_handles: dict[int, str] = field(default_factory=dict)
    retained: tuple[int, ...] = ()
    processing_time_ms: int = -1
    watermark_ms: int = -1
    driver_version: str = ""
