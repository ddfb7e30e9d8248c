"""BytePS-style parameter-server runtime: wire protocol, scheduler, summation server, worker client.

See ``docs/protocol.md`` for the wire format and ``docs/environment.md`` for the variables.
"""

from tagps.ps.client import Handle, PSClient
from tagps.ps.node import JobFailed
from tagps.ps.protocol import ProtocolError
from tagps.ps.scheduler import Scheduler
from tagps.ps.server import SummationServer

__all__ = ["Handle", "JobFailed", "PSClient", "ProtocolError", "Scheduler", "SummationServer"]
