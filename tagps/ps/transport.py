"""ZeroMQ plumbing shared by every node: CURVE keys derived from a secret, binding, host resolution.

With ``TAGPS_PS_SECRET`` set, every socket that binds is a CURVE server and every socket that connects is a
CURVE client; both key pairs are derived from the secret with HMAC-SHA256, so a peer without the secret
neither knows the server's public key (the handshake fails) nor owns the one client key that the ZAP
handler admits. Without a secret, traffic is neither encrypted nor authenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from tagps.config import PSConfig

__all__ = ["CurveKeys", "Security", "bind_random_port", "resolve_host"]

log = logging.getLogger(__name__)

ZAP_DOMAIN = b"tagps"


@dataclass(frozen=True)
class CurveKeys:
    """The two CURVE key pairs of a job (Z85-encoded), derived from its shared secret."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        """Derive both key pairs deterministically from ``secret`` (HMAC-SHA256 as the KDF)."""
        if not secret:
            raise ValueError("TAGPS_PS_SECRET must not be empty")
        if not zmq.has("curve"):
            raise RuntimeError("TAGPS_PS_SECRET is set but this libzmq was built without CURVE")

        def derive(label: bytes) -> tuple[bytes, bytes]:
            secret_key = z85.encode(hmac.new(secret.encode(), label, hashlib.sha256).digest())
            return zmq.curve_public(secret_key), secret_key

        server_public, server_secret = derive(b"tagps-ps curve server key v1")
        client_public, client_secret = derive(b"tagps-ps curve client key v1")
        return cls(server_public, server_secret, client_public, client_secret)


class _OnlyJobClients:
    """ZAP credentials provider that admits exactly the job's client key."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = hmac.compare_digest(key, self._client_public)
        if not allowed:
            log.warning("rejected a CURVE client with an unknown key")
        return allowed


class Security:
    """Apply the job's CURVE settings (or none) to the sockets of one ZeroMQ context.

    Args:
        context: the context whose sockets this object secures.
        secret: the shared secret, or ``None`` for plain TCP.
    """

    def __init__(self, context: zmq.Context, secret: str | None) -> None:
        self.keys = CurveKeys.from_secret(secret) if secret is not None else None
        self._auth: ThreadAuthenticator | None = None
        if self.keys is not None:
            self._auth = ThreadAuthenticator(context, log=logging.getLogger("tagps.ps.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), _OnlyJobClients(self.keys.client_public))

    def server(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (before it binds) a CURVE server that checks clients through ZAP."""
        if self.keys is not None:
            sock.curve_server = True
            sock.curve_secretkey = self.keys.server_secret
            sock.curve_publickey = self.keys.server_public
            sock.zap_domain = ZAP_DOMAIN
        return sock

    def client(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (before it connects) a CURVE client of the job's servers."""
        if self.keys is not None:
            sock.curve_serverkey = self.keys.server_public
            sock.curve_publickey = self.keys.client_public
            sock.curve_secretkey = self.keys.client_secret
        return sock

    def close(self) -> None:
        """Stop the ZAP handler thread."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def resolve_host(config: PSConfig) -> str:
    """Return the address this node binds to and advertises.

    ``DMLC_NODE_HOST`` when set; otherwise the local address of the interface that routes to the scheduler
    (found with an unconnected UDP socket, so no packet is sent).
    """
    if config.node_host:
        return config.node_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((config.root_uri, config.root_port))
        except OSError as exc:
            raise RuntimeError(
                f"cannot find a route to DMLC_PS_ROOT_URI={config.root_uri}; set DMLC_NODE_HOST ({exc})"
            ) from None
        return probe.getsockname()[0]


def bind_random_port(sock: zmq.Socket, host: str) -> int:
    """Bind ``sock`` to a free TCP port on ``host`` (never 0.0.0.0 unless asked) and return the port."""
    try:
        sock.bind(f"tcp://{host}:*")
    except zmq.ZMQError as exc:
        raise RuntimeError(f"cannot bind to DMLC_NODE_HOST={host}: {exc}") from None
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rsplit(":", 1)[1])
