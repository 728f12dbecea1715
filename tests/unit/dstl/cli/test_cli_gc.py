"""``dstl gc`` can never delete a retained checkpoint.

Each manifest records the job's retention; gc keeps at least that many checkpoints, refuses a
smaller ``--retained`` (exit 2, nothing deleted), is conservative with manifests that predate
the field, has ``--dry-run`` (prints the same keys, deletes nothing) and ``--storage-option``.
``--help`` exits 0, usage errors exit 2 — returned by ``dstl.cli.main``, not raised.

Before: ``--retained 1`` on a job retaining 3 deleted two retained manifests (and the objects
only they referenced); there was no ``--dry-run`` or ``--storage-option``; ``--help`` and usage
errors escaped ``main`` as ``SystemExit``.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import pytest

from dstl.checkpoint import CheckpointCoordinator, Manifest
from dstl.cli import main
from dstl.layout import segment_key
from dstl.stores import BlobStore, open_store

HOUR_MS = 3_600_000
OLD_MS = int(time.time() * 1000) - 2 * HOUR_MS


def _segment(store: BlobStore, n: int, created_ms: int = OLD_MS) -> str:
    key = segment_key(created_ms, "a1b2c3d4e5f6", n, 0)
    store.put(key, b"payload %d" % n)
    return key


def _checkpoint(coord: CheckpointCoordinator, keys: list[str]) -> Manifest:
    cid = coord.trigger(["op/0"])
    completion = coord.acknowledge(cid, "op/0", {}, keys, 1, 1)
    assert completion is not None
    return completion.manifest


def _listing(store: BlobStore) -> dict[str, int]:
    return {i.key: i.size for i in store.list()}


def _job(tmp_path: Path, retained: int, checkpoints: int) -> tuple[BlobStore, list[Manifest],
                                                                    list[str]]:
    """A store of job 'clicks' (``retained``) after ``checkpoints`` checkpoints, each naming
    its own segment and the first one; then the leftovers of a crash before each deletion ran:
    every subsumed manifest and its objects are put back."""
    store = open_store(str(tmp_path / "store"))
    coord = CheckpointCoordinator(store, job_id="clicks", retained=retained)
    first = _segment(store, 0)
    saved: dict[str, bytes] = {}
    manifests = []
    for n in range(1, checkpoints + 1):
        seg = _segment(store, n)
        m = _checkpoint(coord, [first, seg])
        manifests.append(m)
        saved.update({m.key: store.get(m.key), seg: store.get(seg)})
    coord.close()
    for key, data in saved.items():
        if store.head(key) is None:
            store.put(key, data)
    return store, manifests, [first]


def _gc(tmp_path: Path, *args: str) -> int:
    return main(["gc", str(tmp_path / "store"), "--job", "clicks", "--min-age", "60", *args])


# ----------------------------------------------------------------- the job's retention


@pytest.mark.parametrize(("retained", "checkpoints"), [(1, 1), (1, 4), (2, 2), (2, 5), (3, 5),
                                                       (4, 3)])
def test_gc_keeps_exactly_what_the_job_retains(tmp_path: Path, retained: int, checkpoints: int,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    store, manifests, _ = _job(tmp_path, retained, checkpoints)
    orphan = _segment(store, 99)
    young = _segment(store, 98, created_ms=int(time.time() * 1000))
    kept = manifests[-retained:]
    assert _gc(tmp_path) == 0
    left = set(_listing(store))
    assert {m.key for m in kept} <= left
    assert {k for m in kept for k in m.referenced_keys} <= left
    assert young in left and orphan not in left
    assert not {m.key for m in manifests[:-retained]} & left
    out = capsys.readouterr().out
    assert f"the job retains {retained}" in out
    store.close()


@pytest.mark.parametrize("asked", [1, 2])
def test_gc_refuses_a_retention_below_the_jobs_and_deletes_nothing(
        tmp_path: Path, asked: int, capsys: pytest.CaptureFixture[str]) -> None:
    store, _, _ = _job(tmp_path, 3, 5)
    _segment(store, 99)  # an orphan: not deleted either
    before = _listing(store)
    assert _gc(tmp_path, "--retained", str(asked)) == 2
    err = capsys.readouterr().err
    assert f"--retained {asked} is smaller than job 'clicks'" in err and "(3," in err
    assert "--retained 3 or more" in err
    assert _listing(store) == before
    store.close()


def test_gc_may_keep_more_than_the_job(tmp_path: Path) -> None:
    store, manifests, _ = _job(tmp_path, 2, 5)
    assert _gc(tmp_path, "--retained", "4") == 0
    left = set(_listing(store))
    assert {m.key for m in manifests[-4:]} <= left and manifests[0].key not in left
    store.close()


def test_gc_is_conservative_with_manifests_that_record_no_retention(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, manifests, _ = _job(tmp_path, 1, 3)
    for m in manifests:  # as an older DSTL wrote them: format v1, no body.retained
        store.delete([m.key])
        store.put(m.key, _as_version_1(m))
    orphan = _segment(store, 99)
    assert _gc(tmp_path, "--retained", "1") == 0
    left = set(_listing(store))
    assert {m.key for m in manifests} <= left  # every checkpoint kept
    assert {k for m in manifests for k in m.referenced_keys} <= left
    assert orphan not in left
    out = capsys.readouterr().out
    assert "predates format version 2" in out and "keeping all 3 checkpoints" in out
    assert "--retained 1 is ignored" in out
    store.close()


def _as_version_1(m: Manifest) -> bytes:
    body = m.to_json_obj()
    del body["retained"]
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    doc = {"format": "dstl-manifest", "version": 1, "crc32": f"{zlib.crc32(canon):08x}",
           "body": body}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def test_gc_of_a_store_without_checkpoints_deletes_old_objects_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(str(tmp_path / "store"))
    old, young = _segment(store, 1), _segment(store, 2, created_ms=int(time.time() * 1000))
    assert _gc(tmp_path) == 0
    assert set(_listing(store)) == {young} and old not in _listing(store)
    assert "has no checkpoint" in capsys.readouterr().out
    store.close()


# ----------------------------------------------------------------- --dry-run


def test_dry_run_prints_what_gc_deletes_and_deletes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, manifests, _ = _job(tmp_path, 2, 4)
    orphan = _segment(store, 99)
    before = _listing(store)
    assert _gc(tmp_path, "--dry-run") == 0
    assert _listing(store) == before
    dry = capsys.readouterr().out.splitlines()
    would = [line.removeprefix("would delete ") for line in dry if line.startswith("would ")]
    assert {manifests[0].key, manifests[1].key, orphan} <= set(would)
    assert dry[-1] == (f"{len(would)} objects would be deleted from {tmp_path / 'store'} "
                       "(dry run: nothing was deleted)")
    assert _gc(tmp_path) == 0
    real = capsys.readouterr().out.splitlines()
    assert [line.removeprefix("deleted ") for line in real if line.startswith("deleted ")] \
        == would
    assert set(_listing(store)) == set(before) - set(would)
    store.close()


# ----------------------------------------------------------------- the command line


@pytest.mark.parametrize("argv", [["gc", "--help"], ["gc", "-h"], ["--help"], ["-h"]])
def test_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "usage: dstl" in out
    if argv[0] == "gc":
        assert "--dry-run" in out and "--storage-option" in out and "--retained" in out


@pytest.mark.parametrize("extra", [
    [], ["--job"], ["--retained", "0"], ["--retained", "x"], ["--retained", "1001"],
    ["--min-age", "-1"], ["--min-age", "nan"], ["--storage-option", "novalue"],
    ["--storage-option", "=x"], ["--storage-option", "a=1", "--storage-option", "a=2"],
    ["--unknown"],
])
def test_usage_errors_exit_2_and_delete_nothing(tmp_path: Path, extra: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    store, _, _ = _job(tmp_path, 1, 2)
    _segment(store, 99)
    before = _listing(store)
    argv = ["gc", str(tmp_path / "store"), "--job", "clicks", "--min-age", "0", *extra]
    if extra[:1] == ["--job"]:
        argv = ["gc", str(tmp_path / "store"), "--job"]
    elif not extra:
        argv = ["gc", str(tmp_path / "store")]  # --job missing
    assert main(argv) == 2
    assert capsys.readouterr().err
    assert _listing(store) == before
    store.close()


@pytest.mark.parametrize("uri", ["s3:/typo/app", "ftp://host/x", "s3://b/app?x=1"])
def test_a_malformed_store_uri_exits_2(tmp_path: Path, uri: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", uri, "--job", "clicks"]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_storage_options_for_a_local_store_exit_2(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert _gc(tmp_path, "--storage-option", "secret=hidden") == 2
    err = capsys.readouterr().err
    assert "storage_options" in err and "hidden" not in err


@pytest.mark.parametrize("argv", [[], ["nope"]])
def test_no_or_an_unknown_command_exits_2(argv: list[str]) -> None:
    assert main(argv) == 2
