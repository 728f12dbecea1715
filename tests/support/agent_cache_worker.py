"""A stand-in Python worker for tests/integration/agent/test_agent_cache.py: its own process, its own
AgentClient, reading through the executor agent's cache.

    python agent_cache_worker.py SOCKET STORE_URI HANDLES_FILE read
        read every handle (JSON lines) through ChangelogReader(storage, cache=AgentCache(...))
        and print {"changes": [[[key_group, payload_hex], ...] per handle]} as JSON
    python agent_cache_worker.py SOCKET STORE_URI HANDLES_FILE hold
        lease the first segment of the first handle, print "held", and wait on stdin with the
        lease open (the test SIGKILLs the process there)
"""

from __future__ import annotations

import json
import sys

from dstl import ChangelogStorage
from dstl.handle import ChangelogHandle
from dstl.spark.agent import AgentCache, AgentClient
from restore.reader import ChangelogReader, verify_segment


def main(argv: list[str]) -> int:
    sock, uri, handles_file, mode = argv
    with open(handles_file) as f:
        handles = [ChangelogHandle.from_json(line) for line in f if line.strip()]
    client = AgentClient(sock)
    storage = ChangelogStorage(uri)
    cache = AgentCache(client, uri, None)
    try:
        if mode == "read":
            reader = ChangelogReader(storage, cache=cache)
            out = [[[kg, payload.hex()] for kg, payload in reader.read(h)] for h in handles]
            print(json.dumps({"changes": out}), flush=True)
        elif mode == "hold":
            key = handles[0].change_sets[0].key
            with cache.lease(storage.store, key, verify=verify_segment):
                print("held", flush=True)
                sys.stdin.read()  # until the test kills this process
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        cache.close()
        storage.close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
