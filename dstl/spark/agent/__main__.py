"""``python -m dstl.spark.agent --dir DIR [--watch-pid PID]``: the executor agent process (started
by :func:`dstl.spark.agent.spawn.ensure_agent`; logs to ``DIR/agent.log``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dstl.spark.agent.server import AgentServer
from dstl.spark.agent.spawn import hold_agent_lock

logger = logging.getLogger("dstl.spark.agent")


def main(argv: list[str] | None = None) -> int:
    """Run the agent of ``--dir`` until it stops; exit 0 at once if another agent holds the
    directory's ``agent.lock``."""
    p = argparse.ArgumentParser(prog="dstl-agent")
    p.add_argument("--dir", required=True)
    p.add_argument("--watch-pid", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        filename=os.path.join(args.dir, "agent.log"))
    lock = hold_agent_lock(args.dir)
    if lock is None:
        logger.info("another agent holds %s/agent.lock; exiting", args.dir)
        return 0
    try:
        AgentServer(args.dir, args.watch_pid).serve()
    finally:
        lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
