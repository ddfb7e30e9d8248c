"""BytePS-style parameter-server runtime: wire protocol, scheduler, summation server, worker client."""

from tagps.ps.client import Handle, PSClient
from tagps.ps.node import JobFailed
from tagps.ps.protocol import ProtocolError

__all__ = ["Handle", "JobFailed", "PSClient", "ProtocolError"]
