"""SegmentRegistry: Flink's TaskChangelogRegistryImplTest, plus pins."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import pytest

from dstl.metrics import MetricsRegistry
from dstl.registry import SegmentRegistry
from dstl.stores import MemoryBlobStore


class _Inline:
    """Runs submitted deletes at once, on the caller's thread (a test executor)."""

    def submit(self, fn: Callable[..., object], *args: object) -> Future[object]:
        f: Future[object] = Future()
        f.set_result(fn(*args))
        return f


@pytest.fixture
def parts() -> tuple[SegmentRegistry, MemoryBlobStore]:
    store = MemoryBlobStore()
    for k in ("dstl/a.seg", "dstl/b.seg"):
        store.put(k, b"x")
    return SegmentRegistry(store, _Inline(), MetricsRegistry("t.")), store  # type: ignore[arg-type]


def _keys(store: MemoryBlobStore) -> list[str]:
    return [o.key for o in store.list()]


def test_discarded_exactly_when_the_count_reaches_zero(parts: tuple) -> None:
    reg, store = parts
    reg.start_tracking("dstl/a.seg", 3)
    reg.release("dstl/a.seg")
    reg.release("dstl/a.seg")
    assert "dstl/a.seg" in _keys(store) and reg.tracked() == {"dstl/a.seg": (1, 0)}
    reg.release("dstl/a.seg")
    assert "dstl/a.seg" not in _keys(store) and reg.tracked() == {}
    reg.release("dstl/a.seg")  # extra release of a forgotten segment: ignored


def test_not_discarded_after_stop_tracking(parts: tuple) -> None:
    reg, store = parts
    reg.start_tracking("dstl/a.seg", 1)
    reg.stop_tracking("dstl/a.seg")
    reg.release("dstl/a.seg")
    assert "dstl/a.seg" in _keys(store)


def test_pinned_segment_outlives_its_references(parts: tuple) -> None:
    reg, store = parts
    reg.start_tracking("dstl/a.seg", 1)
    assert reg.pin(["dstl/a.seg", "dstl/untracked.seg"]) == ["dstl/a.seg"]
    reg.release("dstl/a.seg")
    assert "dstl/a.seg" in _keys(store) and reg.tracked() == {"dstl/a.seg": (0, 1)}
    reg.unpin(["dstl/a.seg"])
    assert "dstl/a.seg" not in _keys(store)


def test_bad_tracking_is_rejected(parts: tuple) -> None:
    reg, _ = parts
    with pytest.raises(ValueError, match="ref_count=0"):
        reg.start_tracking("dstl/a.seg", 0)
    reg.start_tracking("dstl/a.seg", 1)
    with pytest.raises(ValueError, match="already tracked"):
        reg.start_tracking("dstl/a.seg", 1)


def test_delete_failure_is_counted_and_reported() -> None:
    seen: list[str] = []
    metrics = MetricsRegistry("t.")
    reg = SegmentRegistry(MemoryBlobStore(), _Inline(), metrics,  # type: ignore[arg-type]
                          on_delete_error=lambda k, e: seen.append(k))
    reg.start_tracking("../escape", 1)  # an unsafe key: the store refuses the delete
    reg.release("../escape")
    assert seen == ["../escape"] and metrics.snapshot()["t.numberOfDiscardFailures"] == 1
