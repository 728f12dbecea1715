"""Random sequences of rescales against a dict model.

A rule-based machine keeps ``p`` backends (1..8, heap or LMDB each) of one operator over 32 key
groups. Rules: write value/list/map states of random keys, checkpoint (snapshot + complete +
subsume the previous one), materialize some backends, and *rescale*: every backend is lost (a
failover; writes after the last checkpoint are lost with it) and ``p'`` new backends restore
their ranges from the last checkpoint's handles — passed as objects or JSON, shuffled, some of
them several times. Operator ids ``op/p<i>`` are reused across generations, as the Spark operator
does. After every rule each key's states equal the model.

Size: CI (``make test``) a few hundred steps; ``DSTL_DEEP=1`` / profile ``deep`` many more. The
seed is printed (``DSTL_RESCALE_SEED=<n>`` replays one); the figures at the end (run with ``-s``)
summarise the run.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, event, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from restore.restore import restore_backend

MP = 32
KEYS = [f"k{i}" for i in range(24)]
WAIT = 10.0
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
DEEP = os.environ.get("DSTL_DEEP") == "1" or os.environ.get("HYPOTHESIS_PROFILE") == "deep"
EXAMPLES, STEPS = (200, 100) if DEEP else (25, 50)
TABLES = st.lists(st.sampled_from(["heap", "lmdb"]), min_size=8, max_size=8)

#: figures over the whole run (printed at the end)
FIGURES: Counter[str] = Counter()
SEQUENCES: list[str] = []

Model = dict[str, tuple[Any, list[int], dict[int, int]]]


def _kg(key: str) -> int:
    return key_group_for(key.encode(), MP)


class RescaleMachine(RuleBasedStateMachine):
    @initialize(p=st.integers(1, 8), tables=TABLES)
    def start(self, p: int, tables: list[str]) -> None:
        self.store = MemoryBlobStore()
        self.storage = ChangelogStorage(store=self.store, options=DstlOptions(
            persist_delay_s=0.0, preemptive_persist_threshold_bytes=256))
        self.backends = [ChangelogKeyedStateBackend(self.storage, f"op/p{i}",
                                                    KeyGroupRange.of_operator(MP, p, i), MP,
                                                    table=tables[i], options=OPTS)
                         for i in range(p)]
        self.model: Model = {}
        self.cp = 0
        self.handles: list[ChangelogStateBackendHandle] | None = None
        self.model_at_cp: Model = {}
        self.sequence = [str(p)]
        FIGURES["examples"] += 1

    def _owner(self, key: str) -> ChangelogKeyedStateBackend:
        b = next(b for b in self.backends if _kg(key) in b.key_groups)
        b.set_current_key(key)
        return b

    @staticmethod
    def _states(b: ChangelogKeyedStateBackend) -> tuple[Any, Any, Any]:
        return (b.get_state(ValueStateDescriptor("v")), b.get_state(ListStateDescriptor("l")),
                b.get_state(MapStateDescriptor("m")))

    @rule(k=st.sampled_from(KEYS), x=st.integers(0, 99))
    def write(self, k: str, x: int) -> None:
        v, lst, m = self._states(self._owner(k))
        v.update(x)
        lst.add(x)
        m.put(x % 3, x)
        old = self.model.get(k, (None, [], {}))
        self.model[k] = (x, [*old[1], x], {**old[2], x % 3: x})
        FIGURES["writes"] += 1

    @rule(k=st.sampled_from(KEYS), f=st.integers(0, 2))
    def remove(self, k: str, f: int) -> None:
        v, _, m = self._states(self._owner(k))
        v.clear()
        m.remove(f)
        if k in self.model:
            old = self.model[k]
            self.model[k] = (None, old[1], {a: b for a, b in old[2].items() if a != f})

    @rule(then_materialize=st.sets(st.integers(0, 7), max_size=8))
    def checkpoint(self, then_materialize: set[int]) -> None:
        """Checkpoint every backend; then materialize some of them (the checkpoint confirmed
        their previous materialization)."""
        self.cp += 1
        handles = [b.snapshot(self.cp).result(WAIT) for b in self.backends]
        for b in self.backends:
            b.notify_checkpoint_complete(self.cp)
            if self.cp > 1:
                b.notify_checkpoint_subsumed(self.cp - 1)
        self.handles = handles
        self.model_at_cp = {k: (v[0], list(v[1]), dict(v[2])) for k, v in self.model.items()}
        FIGURES["checkpoints"] += 1
        for i in sorted(then_materialize):
            if i < len(self.backends):
                self.materialize(i)

    @rule(which=st.integers(0, 7))
    def materialize(self, which: int) -> None:
        b = self.backends[which % len(self.backends)]
        done = b.materialize_now(WAIT) is not None
        FIGURES["materializations" if done else "materializations skipped"] += 1
        event("materialized" if done else "materialization skipped")

    @precondition(lambda self: self.handles is not None)
    @rule(p=st.integers(1, 8), tables=TABLES, copies=st.integers(1, 3),
          as_json=st.booleans(), order=st.randoms(use_true_random=False))
    def rescale(self, p: int, tables: list[str], copies: int, as_json: bool,
                order: random.Random) -> None:
        assert self.handles is not None
        for b in self.backends:  # a failover: writes after the checkpoint are lost
            b.close()
        self.backends = []
        passed: list[Any] = [h.to_json() if as_json else h for h in self.handles] * copies
        order.shuffle(passed)
        for i in range(p):
            self.backends.append(restore_backend(
                passed, self.storage, KeyGroupRange.of_operator(MP, p, i), table=tables[i],
                operator_id=f"op/p{i}", options=OPTS))
        self.model = {k: (v[0], list(v[1]), dict(v[2])) for k, v in self.model_at_cp.items()}
        self.sequence.append(str(p))
        FIGURES["rescales"] += 1
        FIGURES["restored backends"] += p
        FIGURES[f"restores from {'duplicated ' if copies > 1 else ''}handles"] += 1
        event(f"rescale {len(self.handles)} -> {p}")

    @rule(p=st.integers(1, 8), tables=TABLES, copies=st.integers(1, 3),
          as_json=st.booleans(), order=st.randoms(use_true_random=False))
    def checkpoint_then_rescale(self, p: int, tables: list[str], copies: int, as_json: bool,
                                order: random.Random) -> None:
        """A rescale right after a checkpoint (nothing lost): the common case under Spark."""
        self.checkpoint(set())
        self.rescale(p, tables, copies, as_json, order)

    @invariant()
    def backends_equal_the_model(self) -> None:
        FIGURES["steps"] += 1  # invariants run after every step
        for k in KEYS:
            v, lst, m = self._states(self._owner(k))
            want = self.model.get(k, (None, [], {}))
            assert (v.value(), lst.get(), dict(m.items())) == want, (k, self.sequence)

    @invariant()
    def the_checkpoint_names_only_stored_objects(self) -> None:
        if self.handles is None:
            return
        self.storage._discard.submit(lambda: None).result(WAIT)  # deletions have run
        for h in self.handles:
            for key in h.referenced_keys():
                assert self.store.head(key) is not None, f"checkpoint {self.cp} lost {key}"

    def teardown(self) -> None:
        for b in getattr(self, "backends", []):
            b.close()
        if hasattr(self, "storage"):
            self.storage.close()
            SEQUENCES.append(" -> ".join(self.sequence))


@pytest.mark.timeout(3600 if DEEP else 300)
def test_rescale_sequences_match_a_dict_model() -> None:
    n = int(os.environ.get("DSTL_RESCALE_SEED", "0" if not DEEP else random.randrange(1 << 30)))
    print(f"rescale machine: seed={n} (DSTL_RESCALE_SEED={n} replays it), examples={EXAMPLES}, "
          f"steps<={STEPS}")
    FIGURES.clear()
    SEQUENCES.clear()
    run_state_machine_as_test(
        seed(n)(RescaleMachine),
        settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                          derandomize=False, database=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much]))
    print("rescale machine figures:", dict(sorted(FIGURES.items())))
    print(f"rescale sequences tried ({len(SEQUENCES)}, "
          f"{sum(s.count('->') for s in SEQUENCES)} rescales):")
    for s in SEQUENCES[:40]:
        print("   ", s)
    assert FIGURES["rescales"] > 0
