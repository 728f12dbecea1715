"""Writes ``checkpoint/``: a checkpoint of file-level snapshots (format v2) of an LMDB table of
key layout "1" (LMDB backend; value, list and map states) for the golden restore test
``tests/integration/restore/test_file_snapshot_restore.py::test_v2_layout1_golden_checkpoint_still_restores``.

Run once with the table of key layout "1" (git c905fd8 or earlier); never again: the point of the
files is that today's reader still restores what that writer wrote.
``python tests/data/format/v2_layout1/make_checkpoint.py``.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange  # noqa: E402
from dstl.stores import LocalBlobStore  # noqa: E402
from materializer.backend import ChangelogKeyedStateBackend  # noqa: E402
from materializer.options import BackendOptions  # noqa: E402
from materializer.states import (  # noqa: E402
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)

MP = 16


def main() -> None:
    out = HERE / "checkpoint"
    shutil.rmtree(out, ignore_errors=True)
    store = LocalBlobStore(out / "store")
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
    model: dict[str, list[object]] = {}
    handles = {}
    for table in ("lmdb",):
        b = ChangelogKeyedStateBackend(storage, f"golden-{table}", KeyGroupRange(0, MP - 1), MP,
                                       table=table, options=opts)
        v = b.get_state(ValueStateDescriptor("v"))
        li = b.get_state(ListStateDescriptor("l"))
        m = b.get_state(MapStateDescriptor("m"))
        rng = random.Random(5)
        rows = []
        for phase in (0, 1):
            for i in range(40):
                k = f"key-{rng.randrange(25)}"
                b.set_current_key(k)
                b.set_current_namespace(None if i % 3 else "w")
                v.update(i + phase * 100)
                li.add(i)
                m.put(f"f{i % 4}", [phase, i])
            h = b.snapshot(phase + 1).result(10)
            b.notify_checkpoint_complete(phase + 1)
            if phase == 0:
                assert b.materialize_now(10) is not None
        assert h.materialized and h.non_materialized
        for k in sorted({f"key-{i}" for i in range(25)}):
            b.set_current_key(k)
            for ns in (None, "w"):
                b.set_current_namespace(ns)
                if v.value() is not None:
                    rows.append([k, ns, v.value(), li.get(), sorted(m.items())])
        model[table] = rows
        handles[table] = h.to_json()
        b.close()
    (out / "handles.json").write_text(json.dumps(handles, indent=1, sort_keys=True) + "\n")
    (out / "model.json").write_text(json.dumps(model, indent=1, sort_keys=True) + "\n")
    storage.close()


if __name__ == "__main__":
    main()
