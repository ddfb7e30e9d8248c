"""Horovod over gloo inside a tagps job: the rendezvous ``horovodrun --gloo`` would run, done by rank 0.

``horovodrun --gloo`` starts an HTTP rendezvous server, then every process with its slot as ``HOROVOD_*``
variables. It cannot start processes inside an emulated cluster (network namespaces and cgroups,
:mod:`tagps.cluster.run`), so a job that ``bpslaunch`` or :meth:`tagps.cluster.run.Cluster.run` started
does horovodrun's part itself (:func:`init`): rank 0 starts Horovod's ``RendezvousServer`` for horovodrun's
slot plan, on the job's rendezvous host (``DMLC_PS_ROOT_URI``, rank 0's machine, where the
``torch.distributed`` store is too), the port goes to every rank over ``torch.distributed``, and each
process sets :func:`slot_env` and calls ``horovod.torch.init()``. Ranks follow tagps's (machine-major:
machine ``m`` is Horovod's host ``node<m>``, its local ranks are Horovod's), and gloo binds to the
interface that routes to the rendezvous host (``lo`` in a job on one machine, ``eth0`` in a cluster's).
"""

from __future__ import annotations

import os
import socket
from types import ModuleType

from tagps.config import CommConfig, comm_config

__all__ = ["hosts", "init", "slot_env"]


def _host(machine: int) -> str:
    return f"node{machine}"


def hosts(cfg: CommConfig) -> str:
    """Return the job's machines as ``horovodrun -H`` takes them: ``node0:L0,node1:L1,...``."""
    return ",".join(f"{_host(m)}:{n}" for m, n in enumerate(cfg.sizes))


def slot_env(cfg: CommConfig, addr: str, port: int, iface: str) -> dict[str, str]:
    """Return the ``HOROVOD_*`` variables ``horovodrun --gloo -H`` :func:`hosts` gives ``cfg``'s process.

    Args:
        cfg: this process's place in the job (``DMLC_*``, ``BYTEPS_LOCAL_*``).
        addr: the rendezvous server's address.
        port: the rendezvous server's port.
        iface: the network interface gloo binds to.
    """
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_HOSTNAME": _host(cfg.worker_id),
        "HOROVOD_RANK": str(cfg.rank),
        "HOROVOD_SIZE": str(cfg.size),
        "HOROVOD_LOCAL_RANK": str(cfg.local_rank),
        "HOROVOD_LOCAL_SIZE": str(cfg.local_size),
        "HOROVOD_CROSS_RANK": str(cfg.cross_rank),
        "HOROVOD_CROSS_SIZE": str(cfg.cross_size),
    }


def _iface(host: str) -> str:
    """Return the name of the network interface this process reaches ``host`` through."""
    import psutil  # a dependency of horovod

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # unconnected UDP: picks the route, sends nothing
        address = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    raise RuntimeError(f"no network interface holds {address}, this process's address towards {host}")


def init() -> ModuleType:
    """Join the running tagps job's processes as a Horovod job (after ``tagps.torch.init()``).

    Every rank calls it at the same point; it returns when every rank has joined (the rendezvous server
    is gone by then).

    Returns:
        ``horovod.torch``, initialised.

    Raises:
        RuntimeError: Horovod numbers this process differently from tagps.
    """
    import horovod.torch as hvd
    import torch.distributed as dist
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    cfg = comm_config()
    server = RendezvousServer() if cfg.rank == 0 else None
    port = [0]
    if server is not None:
        port[0] = server.start()
        server.init(get_host_assignments(parse_hosts(hosts(cfg)), cfg.size))
    dist.broadcast_object_list(port, src=0)
    os.environ.update(slot_env(cfg, cfg.root_uri, port[0], _iface(cfg.root_uri)))
    hvd.init()
    dist.barrier()  # every rank is past its rendezvous
    if server is not None:
        server.stop()
    if (hvd.rank(), hvd.size(), hvd.local_rank()) != (cfg.rank, cfg.size, cfg.local_rank):
        raise RuntimeError(
            f"horovod numbers this process rank {hvd.rank()} of {hvd.size()} (local {hvd.local_rank()}); "
            f"tagps: rank {cfg.rank} of {cfg.size} (local {cfg.local_rank})"
        )
    return hvd
