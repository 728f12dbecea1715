"""The operator's Spark job descriptions (:mod:`dstl.spark.jobdesc`) on a fake SparkContext: put
in front of the engine's text, given back after the batch (also a failed one), the job group
never touched; the labels' text."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dstl.spark.jobdesc import DESCRIPTION, BatchJobs, outcome_label, tasks_label


class _Context:
    """A SparkContext's local properties (what the JVM thread holds)."""

    def __init__(self, **props: str) -> None:
        self.props: dict[str, str | None] = dict(props)
        self.calls: list[tuple[str, str | None]] = []

    def getLocalProperty(self, key: str) -> str | None:
        return self.props.get(key)

    def setLocalProperty(self, key: str, value: str | None) -> None:
        self.calls.append((key, value))
        if value is None:
            self.props.pop(key, None)
        else:
            self.props[key] = value


_ENGINE = "my-query\nid = q1\nrunId = r1\nbatch = 7"


def test_labels_go_in_front_of_the_engines_text_and_it_comes_back() -> None:
    sc = _Context(**{DESCRIPTION: _ENGINE, "spark.jobGroup.id": "r1"})
    with BatchJobs(sc, "counts", 7) as jobs:
        jobs.label("state tasks (2 partitions from checkpoint 6)")
        assert sc.props[DESCRIPTION] == ("DSTL operator 'counts', batch 7: state tasks "
                                         f"(2 partitions from checkpoint 6)\n{_ENGINE}")
        jobs.label("sink (...)")
        assert sc.props[DESCRIPTION].startswith("DSTL operator 'counts', batch 7: sink (...)\n")
    assert sc.props[DESCRIPTION] == _ENGINE
    assert {k for k, _ in sc.calls} == {DESCRIPTION}  # the job group is never set
    assert sc.props["spark.jobGroup.id"] == "r1"


def test_a_failed_batch_gives_the_description_back_and_keeps_its_error() -> None:
    sc = _Context()  # outside a streaming query: no description before
    with pytest.raises(KeyError, match="boom"), BatchJobs(sc, "counts", 0) as jobs:
        jobs.label("state tasks (1 partitions from no checkpoint)")
        assert sc.props[DESCRIPTION] == ("DSTL operator 'counts', batch 0: state tasks "
                                         "(1 partitions from no checkpoint)")
        raise KeyError("boom")
    assert DESCRIPTION not in sc.props


def test_a_gateway_that_fails_on_restore_does_not_hide_the_batchs_outcome(
        caplog: pytest.LogCaptureFixture) -> None:
    from py4j.protocol import Py4JError

    class Gone(_Context):
        def setLocalProperty(self, key: str, value: str | None) -> None:
            if value is None or not value.startswith("DSTL"):
                raise Py4JError("gateway closed")
            super().setLocalProperty(key, value)

    sc = Gone(**{DESCRIPTION: _ENGINE})
    with pytest.raises(KeyError, match="boom"), BatchJobs(sc, "c", 1) as jobs:
        jobs.label("x")
        raise KeyError("boom")
    assert "could not restore the job description" in caplog.text


def _report(access: str, rows: int, snapshot: bool, segments: tuple[str, ...]) -> Any:
    return SimpleNamespace(rows_in=rows, slot=SimpleNamespace(access=access),
                           snapshot=object() if snapshot else None, segment_keys=segments)


def test_the_labels_say_what_happened() -> None:
    assert tasks_label(4, -1, True) == ("state tasks (4 partitions from no checkpoint, with "
                                        "the initial state)")
    assert tasks_label(2, 11, False) == "state tasks (2 partitions from checkpoint 11)"
    assert tasks_label(4, 3, False, 2) == "state tasks (4 partitions in 2 tasks from checkpoint 3)"
    assert tasks_label(4, 3, False, 4) == "state tasks (4 partitions from checkpoint 3)"
    reports = [_report("restore", 10, True, ("s1",)), _report("rescale", 5, False, ("s1", "s2")),
               _report("hit", 7, True, ("s2",)), _report("adopt", 0, False, ())]
    assert outcome_label(12, reports, True) == (
        "sink (22 rows in; 2 restores, 2 materializations, 2 segments; checkpoint 12 written)")
    assert outcome_label(12, [], False).endswith("checkpoint 12 not complete)")
