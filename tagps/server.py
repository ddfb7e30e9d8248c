"""``python -m tagps.server``: run one summation server of a PS job (configured by ``DMLC_*`` etc.).

Flags:
    --checkpoint PATH  write the store and optimizer state to PATH (atomically) at a clean shutdown.
    --checkpoint-every N  also write it while serving, at the first step boundary after some key
                       completed N rounds since the last checkpoint (sync mode).
    --restore PATH     start from a checkpoint written by ``--checkpoint`` (same rank and settings).
    --stats PATH       write the data plane's counters (``SummationServer.stats()``: rounds, messages, and
                       the summation's bytes and seconds) to PATH as JSON when the server stops.
"""

from __future__ import annotations

import argparse
import json
import sys

from tagps.atomic import atomic_open
from tagps.config import ConfigError, ps_config, server_optimizer_config
from tagps.ps.node import configure_logging
from tagps.ps.server import SummationServer

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Serve until the job finishes; return the exit status (0 done, 1 failed, 2 bad config or flags)."""
    parser = argparse.ArgumentParser(prog="python -m tagps.server", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", metavar="PATH", help="write the server state here at a clean shutdown"
    )
    parser.add_argument(
        "--checkpoint-every",
        metavar="N",
        type=int,
        help="also write the checkpoint every N rounds, at a step boundary (needs --checkpoint)",
    )
    parser.add_argument("--restore", metavar="PATH", help="start from this checkpoint")
    parser.add_argument("--stats", metavar="PATH", help="write the data plane's counters here (JSON) at exit")
    args = parser.parse_args(argv)
    try:
        config = ps_config(role="server")
        optimizer = server_optimizer_config()
    except ConfigError as exc:
        print(f"tagps.server: {exc}", file=sys.stderr)
        return 2
    configure_logging(config, "server")
    try:
        server = SummationServer(
            config,
            optimizer,
            checkpoint=args.checkpoint,
            restore=args.restore,
            checkpoint_every=args.checkpoint_every,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"tagps.server: {exc}", file=sys.stderr)
        return 2
    status = server.run()
    if args.stats is not None:
        with atomic_open(args.stats) as fh:
            fh.write(json.dumps(server.stats()).encode())
    return status


if __name__ == "__main__":
    sys.exit(main())
