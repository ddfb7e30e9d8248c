"""``python -m tagps.scheduler``: run the scheduler of a PS job (configured by the ``DMLC_*`` variables)."""

from __future__ import annotations

import sys

from tagps.config import ConfigError, ps_config
from tagps.ps.node import configure_logging
from tagps.ps.scheduler import Scheduler

__all__ = ["main"]


def main() -> int:
    """Run the scheduler until the job finishes; return the exit status (0 done, 1 failed, 2 bad config)."""
    try:
        config = ps_config(role="scheduler")
    except ConfigError as exc:
        print(f"tagps.scheduler: {exc}", file=sys.stderr)
        return 2
    configure_logging(config, "scheduler")
    try:
        return Scheduler(config).run()
    except RuntimeError as exc:
        print(f"tagps.scheduler: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
