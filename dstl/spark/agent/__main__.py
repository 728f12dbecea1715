"""``python -m dstl.spark.agent --dir DIR [--watch-pid PID]``: the executor agent process (started
by :func:`dstl.spark.agent.spawn.ensure_agent`; logs to ``DIR/agent.log``).

The agent lives as long as its executor, so its log rotates: at ``DSTL_AGENT_LOG_MAX_BYTES``
(default 10 MiB) ``agent.log`` becomes ``agent.log.1`` and at most ``DSTL_AGENT_LOG_BACKUPS``
(default 5) old files are kept. The agent inherits the executor's environment, so set them with
``spark.executorEnv.DSTL_AGENT_LOG_MAX_BYTES`` and so on."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import sys
from collections.abc import Mapping

from dstl.errors import ConfigError
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
    configure_logging(args.dir, os.environ)
    lock = hold_agent_lock(args.dir)
    if lock is None:
        logger.info("another agent holds %s/agent.lock; exiting", args.dir)
        return 0
    try:
        AgentServer(args.dir, args.watch_pid).serve()
    finally:
        lock.close()
    return 0


#: Defaults of the agent log's rotation (about 60 MiB of disk at most).
LOG_MAX_BYTES = 10 * 2**20
LOG_BACKUPS = 5


def configure_logging(directory: str, env: Mapping[str, str]) -> logging.Handler:
    """Log INFO and above to ``directory/agent.log``, rotated by size (module docstring).

    Raises:
        ConfigError: ``DSTL_AGENT_LOG_MAX_BYTES`` (4096 … 2^40) or ``DSTL_AGENT_LOG_BACKUPS``
            (1 … 1000) is not an integer in range.
    """
    max_bytes = _env_int(env, "DSTL_AGENT_LOG_MAX_BYTES", LOG_MAX_BYTES, 4096, 2**40)
    backups = _env_int(env, "DSTL_AGENT_LOG_BACKUPS", LOG_BACKUPS, 1, 1000)
    handler = logging.handlers.RotatingFileHandler(
        os.path.join(directory, "agent.log"), maxBytes=max_bytes, backupCount=backups)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def _env_int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ConfigError(name, raw, f"an integer {lo} … {hi}", owner="environment",
                          fix="set it with spark.executorEnv." + name)
    return value


if __name__ == "__main__":
    sys.exit(main())
