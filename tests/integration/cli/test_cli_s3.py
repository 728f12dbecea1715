"""The reading commands on S3 (a moto server through s3fs, options given as
``--storage-option k=v``): list, show, verify (and a damaged object named), state dump equal to
the model, changes, inspect by key, and gc with the same options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import moto_server
from support.moto_server import DUMMY_KEY, DUMMY_SECRET, REGION, s3_storage_options
from support.state_job import MiniJob, state_of

from dstl.cli import main
from dstl.reader import from_json
from dstl.stores import open_store

pytestmark = pytest.mark.s3
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket


class _Row:
    def __init__(self, d: dict[str, object]) -> None:
        for f in ("key", "namespace", "user_key", "value"):
            d[f] = from_json(json.dumps(d[f])) if d[f] is not None else None
        self.__dict__.update(d)


def test_cli_reads_a_job_on_s3(moto_endpoint: str, s3_bucket: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/app"
    store = open_store(uri, storage_options=s3_storage_options(moto_endpoint))
    job = MiniJob(store, partitions=2, seed=31, retained=3)
    job.run(100)
    job.checkpoint()
    job.materialize()
    job.run(60)
    job.checkpoint()
    job.close()
    opts = ["--storage-option", f"key={DUMMY_KEY}", "--storage-option", f"secret={DUMMY_SECRET}",
            "--storage-option", f"client_kwargs.endpoint_url={moto_endpoint}",
            "--storage-option", f"client_kwargs.region_name={REGION}"]
    try:
        assert main(["checkpoints", "list", uri, "--json", *opts]) == 0
        assert [json.loads(x)["checkpoint"] for x in capsys.readouterr().out.splitlines()] == \
            [0, 1]
        assert main(["checkpoints", "show", uri, "--json", *opts]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert main(["verify", uri, "--job", "job", *opts]) == 0
        assert capsys.readouterr().out.rstrip().endswith("OK")
        assert main(["state", "dump", uri, *opts]) == 0
        rows = [_Row(json.loads(x)) for x in capsys.readouterr().out.splitlines()]
        assert state_of(rows) == job.checkpoint_models[1]
        assert main(["state", "changes", uri, "--start", "0", *opts]) == 0
        assert {json.loads(x)["checkpoint"] for x in capsys.readouterr().out.splitlines()} == {1}
        snapshot = shown["tasks"][0]["snapshots"][0]["key"]
        assert main(["inspect", uri, "--key", snapshot, *opts]) == 0
        assert ": snapshot," in capsys.readouterr().out
        # a damaged segment is named by verify; credentials never reach the output
        segment = shown["tasks"][1]["logs"][-1]["segments"][0]
        data = bytearray(store.get(segment))
        data[12] ^= 0xFF
        store.delete([segment])
        store.put(segment, bytes(data))
        assert main(["verify", uri, "--quiet", *opts]) == 1
        out, err = capsys.readouterr()
        assert f"PROBLEM {segment}: ChecksumMismatchError" in out
        assert DUMMY_SECRET not in out + err
        assert main(["gc", uri, "--job", "job", "--min-age", "0", *opts]) == 0
        assert "objects deleted from" in capsys.readouterr().out
        # a store that does not exist is a usage error (exit 2), as a missing directory is:
        # a bucket that is not there, and a prefix that holds no DSTL store (a typo)
        for cmd in (["checkpoints", "list"], ["verify"], ["state", "dump"]):
            assert main([*cmd, f"s3://{s3_bucket}-absent/app", *opts]) == 2, cmd
            assert "bucket" in capsys.readouterr().err, cmd
            assert main([*cmd, f"s3://{s3_bucket}/nothing-here", *opts]) == 2, cmd
            assert (f"NoStoreError: no DSTL store at s3://{s3_bucket}/nothing-here: nothing is "
                    "stored below its checkpoints/, dstl/ or snapshots/ (a mistyped bucket or "
                    "prefix?); pass the state_uri the job "
                    "writes to") in capsys.readouterr().err, cmd
        capsys.readouterr()
    finally:
        store.close()
