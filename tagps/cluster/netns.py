"""Emulated machines on one host: network namespaces on a Linux bridge with ``tc`` link limits.

Every node of a :class:`Network` is a network namespace with one interface, ``eth0``, that is one end of a
veth pair; the other end is enslaved to the network's bridge in the root namespace. A node's
:class:`LinkLimit` is applied in both directions, like a full-duplex NIC: a token bucket (``tbf``) on
``eth0`` limits what the node sends, one on the bridge side limits what it receives; an optional one-way
delay (``netem``, on ``eth0``) is added to every packet the node sends, so the round trip between nodes
``a`` and ``b`` grows by ``delay_a + delay_b``.

Only the project's own names and addresses are used: every namespace and link is named ``tagps-<k>...``
(``k`` numbers the networks that exist at once) and network ``k`` takes ``198.18.<k>.0/24`` from the
benchmarking range 198.18.0.0/15 (RFC 2544), so no traffic ever looks like it targets a real network.
:func:`down_all` therefore removes exactly what the project made, also after a crash, and is idempotent.
Everything here needs root (``CAP_NET_ADMIN``) and ``ip``/``tc`` from iproute2.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NETWORK",
    "PREFIX",
    "ClusterError",
    "LinkLimit",
    "Network",
    "Node",
    "check_support",
    "down_all",
    "up",
]

PREFIX = "tagps-"
NETWORK = ipaddress.ip_network("198.18.0.0/15")
_MAX_NETWORKS = NETWORK.num_addresses // 256  # one /24 per network: 512
_MAX_NODES = 254
_NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_LOCK = "/run/lock/tagps-cluster.lock"
# Token bucket shape: a bucket of 1 ms at line rate and a queue that holds 20 ms at line rate, roughly a
# switch port's buffer. The bucket holds at least two whole GSO packets (64 KiB of payload; tbf counts
# each segment's headers too, about 68 KiB): tbf cuts a packet larger than its bucket into MTU-sized
# segments, and the receiver then pays its TCP stack per 1500-byte packet. With 64 KiB (the bucket of
# every link under 525 Mbit/s until 2026-12-07) receiving at 200-500 Mbit/s took 0.2-0.6 of a core on
# this 2-core host (8-20 ns a byte, near a small quota's whole share), against 0.02-0.05 now.
_BURST_S, _MIN_BURST_BYTES, _QUEUE_S = 0.001, 131072, 0.020


class ClusterError(RuntimeError):
    """The emulated network cannot be built or removed (not root, tools missing, the kernel refuses)."""


@dataclass(frozen=True)
class LinkLimit:
    """Limits of one node's link to the bridge.

    Args:
        rate_mbit: rate in Mbit/s in each direction (``None``: unlimited).
        delay_ms: one-way delay in ms added to every packet the node sends (default 0; needs ``netem``).
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 (or None for no limit), got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")


@dataclass(frozen=True)
class Node:
    """One emulated machine.

    Args:
        name: the caller's name for it, e.g. ``"worker0"``.
        netns: its network namespace, e.g. ``"tagps-3-worker0"``.
        address: its IPv4 address on the network (from 198.18.0.0/15).
        host_ifname: the bridge-side end of its veth pair, e.g. ``"tagps-3v0"``.
        limit: its link limits.
    """

    name: str
    netns: str
    address: str
    host_ifname: str
    limit: LinkLimit


def _ip_tool(tool: str) -> str:
    path = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")  # sbin: often not on PATH
    if path is None:
        raise ClusterError(f"`{tool}` was not found; install iproute2 (apt-get install iproute2)")
    return path


def check_support() -> None:
    """Raise :class:`ClusterError` unless this process can build emulated networks (root, ``ip``, ``tc``)."""
    if os.geteuid() != 0:
        raise ClusterError("emulated networks need root (CAP_NET_ADMIN): run as root, or skip this part")
    _ip_tool("ip")
    _ip_tool("tc")


def _run(tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [_ip_tool(tool), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        message = res.stderr.strip() or res.stdout.strip()
        if "Specified qdisc kind is unknown" in message and "netem" in args:
            raise ClusterError(
                "delay needs the netem qdisc (kernel module sch_netem), which this kernel lacks"
            )
        raise ClusterError(f"`{' '.join([tool, *args])}` failed: {message}")
    return res


def _json(tool: str, *args: str) -> list[dict[str, Any]]:
    out = _run(tool, "-j", *args).stdout.strip()
    return json.loads(out) if out else []


def _namespaces() -> list[str]:
    return [ns["name"] for ns in _json("ip", "netns", "list")]


def _links() -> list[str]:
    return [link["ifname"] for link in _json("ip", "link", "show")]


def _kill_and_delete_netns(netns: str) -> None:
    """Kill every process inside ``netns`` (they would keep it alive) and delete it, with its veth ends."""
    pids = _run("ip", "netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "delete", netns, check=False)


def _delete_links(names: Sequence[str]) -> None:
    # Deleting one end of a veth pair deletes the other: ignore links already gone.
    for name in names:
        _run("ip", "link", "delete", name, check=False)


@contextlib.contextmanager
def _creation_lock() -> Iterator[None]:
    with open(_LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tbf(dev: str, rate_mbit: float, netns: str | None, parent: str) -> None:
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(_MIN_BURST_BYTES, int(rate_bytes * _BURST_S))
    limit = burst + int(rate_bytes * _QUEUE_S)
    ns = ["-n", netns] if netns else []
    spec = f"qdisc replace dev {dev} {parent} tbf rate {rate_mbit}mbit burst {burst} limit {limit}"
    _run("tc", *ns, *spec.split())


def _limit(node: Node) -> None:
    """Apply ``node.limit``: what it sends is shaped on ``eth0``, what it receives on the bridge side."""
    limit = node.limit
    root = "root handle 1:"
    if limit.delay_ms > 0:
        spec = f"qdisc replace dev eth0 {root} netem delay {limit.delay_ms}ms limit 100000"
        _run("tc", "-n", node.netns, *spec.split())
    if limit.rate_mbit is not None:
        _tbf("eth0", limit.rate_mbit, node.netns, "parent 1:1 handle 10:" if limit.delay_ms else root)
        _tbf(node.host_ifname, limit.rate_mbit, None, root)


class Network:
    """Nodes (network namespaces) on one bridge; build it with :func:`up`, remove it with :meth:`down`.

    Use it as a context manager so that it is removed however the block ends.
    """

    def __init__(self, index: int, nodes: Mapping[str, Node], mtu: int) -> None:
        self.index = index
        self.bridge = f"{PREFIX}{index}b"
        self.subnet = ipaddress.ip_network(f"{NETWORK.network_address + 256 * index}/24")
        self.nodes = dict(nodes)
        self.mtu = mtu

    def __repr__(self) -> str:
        return f"Network({self.bridge}, {self.subnet}, nodes={list(self.nodes)})"

    def node(self, name: str) -> Node:
        """Return the node called ``name``; raise ``KeyError`` naming the known ones otherwise."""
        try:
            return self.nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r} in this network; nodes: {', '.join(self.nodes)}") from None

    def address(self, name: str) -> str:
        """Return the IPv4 address of node ``name``."""
        return self.node(name).address

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """Return the command line that runs ``argv`` inside node ``name`` (``ip netns exec`` execs it, so
        the pid and process group of the started process are those of ``argv`` itself)."""
        if not argv:
            raise ValueError("empty command")
        return [_ip_tool("ip"), "netns", "exec", self.node(name).netns, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``name``; ``kwargs`` go to :class:`subprocess.Popen`."""
        return subprocess.Popen(self.exec_argv(name, argv), **kwargs)

    def run(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``name`` to completion; ``kwargs`` go to :func:`subprocess.run`."""
        return subprocess.run(self.exec_argv(name, argv), **kwargs)

    def down(self) -> None:
        """Remove this network: kill the processes in its namespaces, delete them, its veths and bridge.

        Idempotent; safe to call on a half-built network.
        """
        for node in self.nodes.values():
            _kill_and_delete_netns(node.netns)
        _delete_links([n.host_ifname for n in self.nodes.values()] + [self.bridge])

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def up(
    nodes: Sequence[str] | Mapping[str, LinkLimit],
    limit: LinkLimit | None = None,
    mtu: int = 1500,
) -> Network:
    """Build a network of emulated machines.

    Args:
        nodes: node names (lower-case letters, digits, ``-``, ``_``; at most 32 characters), or a mapping
            from name to that node's :class:`LinkLimit`.
        limit: the limit of every node given by name only (default: unlimited).
        mtu: MTU of every link (default 1500, as on a real Ethernet).

    Returns:
        The :class:`Network`; node ``i`` (in the given order) has address ``198.18.<k>.<i+1>``.

    Raises:
        ValueError: bad names, too many nodes, bad MTU, or a limit given twice.
        ClusterError: not root, ``ip``/``tc`` missing, no free network number, or the kernel refused.
    """
    if isinstance(nodes, str):
        raise TypeError("nodes must be a sequence or mapping of names, not one string")
    if isinstance(nodes, Mapping):
        if limit is not None:
            raise ValueError("give either per-node limits (a mapping) or one `limit` for all, not both")
        limits = dict(nodes)
    else:
        limits = {name: limit or LinkLimit() for name in nodes}
    if not 1 <= len(limits) <= _MAX_NODES or len(limits) != len(list(nodes)):
        raise ValueError(f"need 1 to {_MAX_NODES} distinct node names, got {list(nodes)}")
    for name, lim in limits.items():
        if not isinstance(name, str) or not _NODE_NAME.match(name):
            raise ValueError(f"bad node name {name!r}: use [a-z0-9][a-z0-9_-]*, at most 32 characters")
        if not isinstance(lim, LinkLimit):
            raise TypeError(f"limit of node {name!r} must be a LinkLimit, got {type(lim).__name__}")
    if not 68 <= mtu <= 65535:
        raise ValueError(f"mtu must be in [68, 65535], got {mtu}")
    check_support()
    with _creation_lock():
        taken = set(_links())
        index = next((k for k in range(_MAX_NETWORKS) if f"{PREFIX}{k}b" not in taken), None)
        if index is None:
            raise ClusterError(f"all {_MAX_NETWORKS} network numbers are taken; run `tagps cluster down`")
        base = NETWORK.network_address + 256 * index
        network = Network(
            index,
            {
                name: Node(name, f"{PREFIX}{index}-{name}", str(base + i + 1), f"{PREFIX}{index}v{i}", lim)
                for i, (name, lim) in enumerate(limits.items())
            },
            mtu,
        )
        try:
            _run("ip", "link", "add", network.bridge, "mtu", str(mtu), "type", "bridge")
            _run("ip", "link", "set", network.bridge, "up")
        except BaseException:
            network.down()
            raise
    try:
        for node in network.nodes.values():
            _attach(network, node)
    except BaseException:
        network.down()
        raise
    return network


def _attach(network: Network, node: Node) -> None:
    mtu = str(network.mtu)
    _run("ip", "netns", "add", node.netns)
    _run("ip", "-n", node.netns, "link", "set", "lo", "up")
    veth = f"link add {node.host_ifname} mtu {mtu} type veth peer name eth0 mtu {mtu} netns {node.netns}"
    _run("ip", *veth.split())
    _run("ip", "link", "set", node.host_ifname, "master", network.bridge, "up")
    _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/{network.subnet.prefixlen}", "dev", "eth0")
    _run("ip", "-n", node.netns, "link", "set", "eth0", "up")
    _limit(node)


def down_all(index: int | None = None) -> list[str]:
    """Remove every namespace and link whose name starts with ``tagps-`` (and kill processes inside them).

    Idempotent: what is already gone is skipped. Use it after a crash, or via ``tagps cluster down``.

    Args:
        index: remove only network number ``index`` (:attr:`Network.index`); default: all of them.

    Returns:
        The names of the namespaces and links it removed.
    """
    if index is not None and not 0 <= index < _MAX_NETWORKS:
        raise ValueError(f"index must be in [0, {_MAX_NETWORKS}), got {index}")
    check_support()
    netns_prefix = PREFIX if index is None else f"{PREFIX}{index}-"
    link_name = re.compile(re.escape(PREFIX) + (r"" if index is None else rf"{index}[bv]"))
    removed = []
    for netns in _namespaces():
        if netns.startswith(netns_prefix):
            _kill_and_delete_netns(netns)
            removed.append(netns)
    links = [name for name in _links() if link_name.match(name)]
    _delete_links(links)
    return removed + links
