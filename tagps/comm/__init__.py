"""Communication service: collectives, intra-machine reduction, the PS path and SFB (framework side)."""

from tagps.comm.handle import CompletedWork, Handle, Waitable

__all__ = ["CompletedWork", "Handle", "Waitable"]
