"""Emulated clusters from a spec: bring them up, measure them, run BytePS-style jobs in them, remove them.

:func:`up` builds one network namespace per machine of a :class:`~tagps.cluster.spec.ClusterSpec` (veth to
a bridge, ``tc`` rate and delay per machine, :mod:`tagps.cluster.netns`) and one CPU cgroup per machine
with a quota (:mod:`tagps.cluster.cgroup`), and records it in ``/run/tagps/cluster-<name>.json`` so that
later commands (``tagps cluster run``) find it. :meth:`Cluster.topology` measures every link (round trip and
TCP goodput between each pair of worker machines and inside each one) and a device's matmul rate under its
machine's quota, and returns the matching :class:`~tagps.strategy.topology.Topology`, so that ``tagps plan``
and ``tagps simulate`` see the cluster the jobs run on (a machine with servers but no workers becomes a
server-only device group). :meth:`Cluster.job` describes a job as ``bpslaunch``
processes (scheduler, servers, one worker process per device) with the right ``DMLC_*`` variables, each
started inside its machine's namespace and cgroup; :meth:`Cluster.run` supervises it like ``bpslaunch``.
:func:`down_all` removes every namespace, link, cgroup and record the project made, also after a crash.

Every worker process is one device with one compute thread (``OMP_NUM_THREADS=1``); its machine's quota is
shared by everything that machine runs. ``torch.distributed`` traffic leaves through ``eth0``
(``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tagps.atomic import write_text_atomic
from tagps.cluster import cgroup as cg
from tagps.cluster import netns
from tagps.cluster.measure import MATMUL_N, LinkMeasurement, measure_pair
from tagps.cluster.spec import ClusterSpec, MachineSpec, load_spec
from tagps.launcher import ProcessSpec, run_processes
from tagps.strategy.topology import SERVER_INTRA_GBPS, DeviceGroup, Link, Topology

__all__ = ["STATE_DIR", "Cluster", "attach", "down", "down_all", "running", "up"]

STATE_DIR = Path("/run/tagps")
_PROBE_PORT = 7000
# A device's compute rate: single-threaded float32 matmuls of measure_core's size, counted over a window of
# wall-clock time that the parent gives every probe of every machine measured together once all of them are
# ready (stdin: start and end), so that all of them compete for their quotas and the host's cores and caches
# the whole window, as training steps do (one that started or ended alone would read a whole quota).
_FLOPS_PROBE = (
    "import sys, time, torch\n"
    "torch.set_num_threads(1)\n"
    f"a = torch.randn({MATMUL_N}, {MATMUL_N}); b = torch.randn({MATMUL_N}, {MATMUL_N})\n"
    "for _ in range(3): a @ b\n"
    "print('ready', flush=True)\n"
    "start, end = map(float, sys.stdin.readline().split())\n"
    "while time.time() < start: a @ b\n"
    "n = 0\n"
    "while time.time() < end: a @ b; n += 1\n"
    f"print(2 * {MATMUL_N} ** 3 * n / (end - start))\n"
)
_PROBE_READY_S = 120.0  # importing torch on a small share of a core, with every probe of the machine at it


def _state_path(name: str) -> Path:
    return STATE_DIR / f"cluster-{name}.json"


@dataclass
class Cluster:
    """A running emulated cluster: its spec, network and CPU cgroups.

    Args:
        spec: what it was built from.
        network: one node per machine, named like the machines.
        cgroups: machine name → its CPU cgroup (machines without a quota are absent).
    """

    spec: ClusterSpec
    network: netns.Network
    cgroups: dict[str, cg.CpuCgroup]

    def __repr__(self) -> str:
        return f"Cluster({self.spec.name!r}, {self.network!r})"

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ processes
    def exec_argv(self, machine: str, argv: Sequence[str]) -> list[str]:
        """Return the command line that runs ``argv`` in ``machine``'s namespace and cgroup."""
        return cg.join_argv(self.cgroups.get(machine), self.network.exec_argv(machine, argv))

    def address(self, machine: str) -> str:
        """IPv4 address of ``machine``."""
        return self.network.address(machine)

    def job(
        self,
        command: Sequence[str],
        devices: Sequence[str] | None = None,
        servers: Mapping[str, int] | None = None,
        env: Mapping[str, str] = os.environ,
    ) -> list[ProcessSpec]:
        """Describe a job: scheduler and servers (when there are servers), then one worker per device.

        Worker ranks follow ``devices`` (machine-major, the order plans use). Each machine used is one
        BytePS worker whose devices are its local ranks, so the ``ps`` path reduces inside it first and
        pushes once per machine, whatever the machines' sizes (``TAGPS_MACHINE_SIZES``). The scheduler
        and ``torch.distributed``'s rendezvous (rank 0) share the first device's machine.

        Args:
            command: the worker command.
            devices: ``"<machine>:<index>"`` names to run a worker on (default: every device of the spec).
            servers: machine → summation servers on it (default: the spec's ``servers``).
            env: the environment the processes inherit (layout variables are set per process).

        Raises:
            ValueError: an empty command, unknown or repeated devices, devices out of machine order, or
                servers on an unknown machine.
        """
        if not command:
            raise ValueError("the worker command is empty")
        devices = list(self.spec.devices() if devices is None else devices)
        known = self.spec.devices()
        bad = [d for d in devices if d not in known]
        if bad or not devices or len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct names from {known}; got {devices}")
        order = [known.index(d) for d in devices]
        if order != sorted(order):
            raise ValueError(f"devices must be in machine-major order {known}; got {devices}")
        servers = {m.name: m.servers for m in self.spec.machines} if servers is None else dict(servers)
        for name, count in servers.items():
            self.spec.machine(name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"servers on {name!r} must be an integer >= 0, got {count!r}")
        per_machine: dict[str, list[int]] = {}
        for d in devices:
            machine, index = d.split(":")
            per_machine.setdefault(machine, []).append(int(index))
        sizes = [len(v) for v in per_machine.values()]
        num_workers = len(sizes)
        num_servers = sum(servers.values())
        first = next(iter(per_machine))
        root_port = random.randrange(20000, 60000, 2)  # fresh namespaces: nothing else listens there
        common = {
            "DMLC_NUM_WORKER": str(num_workers),
            "DMLC_NUM_SERVER": str(num_servers),
            "DMLC_PS_ROOT_URI": self.address(first),
            "DMLC_PS_ROOT_PORT": str(root_port),
            "TAGPS_DIST_PORT": str(root_port + 1),
            "TAGPS_MACHINE_SIZES": ",".join(map(str, sizes)),
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        base = {k: v for k, v in env.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL_"))}
        base.update(common)
        specs: list[ProcessSpec] = []

        def service(label: str, machine: str, role: str) -> ProcessSpec:
            argv = self.exec_argv(machine, [sys.executable, "-m", f"tagps.{role}"])
            node_env = {**base, "DMLC_ROLE": role, "DMLC_NODE_HOST": self.address(machine)}
            return ProcessSpec(label, tuple(argv), node_env, service=True)

        if num_servers:
            specs.append(service(f"scheduler@{first}", first, "scheduler"))
            for machine, count in servers.items():
                specs += [service(f"server {machine}.{s}", machine, "server") for s in range(count)]
        for worker_id, (machine, indices) in enumerate(per_machine.items()):
            for local_rank, index in enumerate(indices):
                worker_env = {
                    **base,
                    "DMLC_ROLE": "worker",
                    "DMLC_WORKER_ID": str(worker_id),
                    "DMLC_NODE_HOST": self.address(machine),
                    "BYTEPS_LOCAL_RANK": str(local_rank),
                    "BYTEPS_LOCAL_SIZE": str(len(indices)),
                    "TAGPS_DEVICE": f"{machine}:{index}",
                }
                argv = tuple(self.exec_argv(machine, command))
                specs.append(ProcessSpec(f"worker {machine}:{index}", argv, worker_env))
        return specs

    def run(
        self,
        command: Sequence[str],
        devices: Sequence[str] | None = None,
        servers: Mapping[str, int] | None = None,
        env: Mapping[str, str] = os.environ,
        out: BinaryIO | None = None,
        grace: float = 5.0,
    ) -> int:
        """Run :meth:`job` under ``bpslaunch``'s supervision and return its exit status (main thread only)."""
        return run_processes(self.job(command, devices, servers, env), out=out, grace=grace)

    # ------------------------------------------------------------------ measurements
    def _measure(self, server: str, client: str, seconds: float) -> LinkMeasurement:
        return measure_pair(
            lambda argv: self.exec_argv(server, argv),
            lambda argv: self.exec_argv(client, argv),
            self.address(server),
            _PROBE_PORT,
            seconds,
        )

    def device_flops(self, machines: Sequence[MachineSpec], seconds: float = 3.0) -> dict[str, float]:
        """Measure each machine's device float32 matmul rate, every device of every one of ``machines`` busy
        at once: the mean of a machine's devices, by machine name.

        Every probe counts its matmuls over the same window of ``seconds``, which starts once all of them
        have imported torch: a probe that ran part of its time alone (the others still importing, or
        done) would read the share of the whole machine, not of one device, and machines measured one at
        a time would not compete for the host's cores and caches as training steps do. ``seconds`` spans
        many periods of the machines' CPU quotas, which quantize a short probe.

        Raises:
            RuntimeError: a probe failed, or was not ready within two minutes.
        """
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with contextlib.ExitStack() as stack:
            procs = [
                (
                    machine.name,
                    stack.enter_context(
                        subprocess.Popen(
                            self.exec_argv(machine.name, [sys.executable, "-c", _FLOPS_PROBE]),
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                            env=env,
                        )
                    ),
                )
                for machine in machines
                for _ in range(machine.workers)
            ]
            # Kill leftovers before their exits wait on them.
            stack.callback(lambda: [p.kill() for _, p in procs if p.poll() is None])
            deadline = time.monotonic() + _PROBE_READY_S
            for name, p in procs:
                ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready or p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                    p.kill()
                    raise RuntimeError(
                        f"compute probe on {name!r} failed or not ready in {_PROBE_READY_S:.0f} s: "
                        f"{p.communicate()[1].strip()[-2000:]}"
                    )
            start = time.time() + 0.05  # every probe reads its line well before it
            for _, p in procs:
                p.stdin.write(f"{start!r} {start + seconds!r}\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]  # (communicate closes it)
            rates: dict[str, list[float]] = {}
            for name, p in procs:
                out, err = p.communicate(timeout=seconds + 60)
                if p.returncode != 0:
                    raise RuntimeError(f"compute probe on {name!r} failed: {err.strip()[-2000:]}")
                rates.setdefault(name, []).append(float(out))
        return {name: statistics.mean(r) for name, r in rates.items()}

    def topology(self, seconds: float = 0.5) -> Topology:
        """Measure the cluster and return its topology (one CPU device group per machine, in spec order).

        A machine with workers is a device group of that many devices; a machine with servers only is a
        server-only device group (count 0), where plans may put PS servers (``Plan.ps_servers``).
        Bandwidths are TCP goodputs: between two machines (each pair but two server-only ones, which never
        talk), and inside a worker machine over loopback (both ends under its quota); latencies are half
        the median round trip of 64-byte messages. Every worker group's ``peak_flops`` is its devices'
        measured matmul rate; the simulator's efficiency constants relate real ops to it
        (``tagps.strategy.calibration``).

        Args:
            seconds: how long each goodput probe streams (default 0.5).
        """
        machines = self.spec.machines
        workers = self.spec.worker_machines
        intra: dict[str, LinkMeasurement] = {m.name: self._measure(m.name, m.name, seconds) for m in workers}
        flops = self.device_flops(workers)
        inter: dict[tuple[str, str], LinkMeasurement] = {}
        for i, a in enumerate(machines):
            for b in machines[i + 1 :]:
                if a.workers or b.workers:
                    inter[(a.name, b.name)] = self._measure(a.name, b.name, seconds)
        groups = tuple(
            DeviceGroup(
                m.name,
                "CPU",
                m.workers,
                round(intra[m.name].bandwidth_Bps * 8 / 1e9, 4),
                peak_flops=round(flops[m.name], -6),
                cpu_cores=m.cpu or 0.0,
            )
            if m.workers
            else DeviceGroup(m.name, "CPU", 0, SERVER_INTRA_GBPS)
            for m in machines
        )
        links = tuple(Link(a, b, round(m.bandwidth_Bps * 8 / 1e9, 4)) for (a, b), m in inter.items())
        slowest_intra = min(g.intra_bandwidth_gbps for g in groups if not g.server_only)
        inter_bw = min((ln.bandwidth_gbps for ln in links), default=slowest_intra)
        rtt_inter = [m.rtt_s for m in inter.values()] or [m.rtt_s for m in intra.values()]
        return Topology(
            self.spec.name,
            groups,
            inter_bw,
            links,
            intra_latency_s=statistics.median(m.rtt_s for m in intra.values()) / 2,
            inter_latency_s=statistics.median(rtt_inter) / 2,
        )

    # ------------------------------------------------------------------ teardown
    def down(self) -> None:
        """Remove the cluster: its processes, namespaces, links, cgroups and record; idempotent."""
        self.network.down()
        for group in self.cgroups.values():
            group.remove()
        _state_path(self.spec.name).unlink(missing_ok=True)

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {
            "spec": self.spec.to_dict(),
            "index": self.network.index,
            "mtu": self.network.mtu,
            "nodes": {
                n.name: {"netns": n.netns, "address": n.address, "host_ifname": n.host_ifname}
                for n in self.network.nodes.values()
            },
            "cgroups": {name: [str(g.path), g.version, g.cores] for name, g in self.cgroups.items()},
        }
        write_text_atomic(_state_path(self.spec.name), json.dumps(state, indent=1))


def up(spec: ClusterSpec | str | Path | Mapping[str, Any]) -> Cluster:
    """Build the cluster of ``spec`` (a spec, its dict form or a YAML/JSON file) and record it.

    Raises:
        ValueError: a malformed spec.
        ClusterError: not root, tools or cgroup controller missing, a cluster of that name is already up
            (``tagps cluster down`` removes it), or the kernel refused; what was built is removed again.
    """
    spec = load_spec(spec)
    netns.check_support()
    if attach(spec.name) is not None:
        raise netns.ClusterError(
            f"cluster {spec.name!r} is already up ({_state_path(spec.name)}); run `tagps cluster down` first"
        )
    limits = {m.name: netns.LinkLimit(m.rate_mbit, m.delay_ms) for m in spec.machines}
    network = netns.up(limits)
    cluster = Cluster(spec, network, {})
    try:
        for m in spec.machines:
            if m.cpu is not None:
                cluster.cgroups[m.name] = cg.create(network.node(m.name).netns, m.cpu)
        cluster._save()
    except BaseException:
        cluster.down()
        raise
    return cluster


def attach(name: str) -> Cluster | None:
    """Return the cluster ``name`` that :func:`up` recorded, or ``None`` when none is up.

    A record whose namespaces are gone (a reboot, ``tagps cluster down``) is deleted and ``None`` returned.
    """
    path = _state_path(name)
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    spec = ClusterSpec.from_dict(state["spec"])
    nodes = {
        m.name: netns.Node(m.name, **state["nodes"][m.name], limit=netns.LinkLimit(m.rate_mbit, m.delay_ms))
        for m in spec.machines
    }
    live = set(netns._namespaces())
    if any(n.netns not in live for n in nodes.values()):
        path.unlink(missing_ok=True)
        return None
    groups = {m: cg.CpuCgroup(Path(p), v, c) for m, (p, v, c) in state["cgroups"].items()}
    return Cluster(spec, netns.Network(state["index"], nodes, state["mtu"]), groups)


@contextlib.contextmanager
def running(spec: ClusterSpec) -> Iterator[Cluster]:
    """The cluster of ``spec`` for a block: the one already up (left up after it), else one :func:`up`
    brings up and takes down again after the block, whatever ends it.

    Raises:
        ClusterError, ValueError: as :func:`up`.
    """
    cluster = attach(spec.name)
    if cluster is not None:
        yield cluster
        return
    cluster = up(spec)
    try:
        yield cluster
    finally:
        cluster.down()


def down(name: str) -> list[str]:
    """Remove the cluster ``name`` recorded by :func:`up` (also after a crash of whatever ran it).

    Returns:
        What it removed (empty when no cluster of that name is recorded).
    """
    netns.check_support()
    cluster = attach(name)
    if cluster is None:
        return []
    removed = [n.netns for n in cluster.network.nodes.values()] + [cluster.network.bridge]
    removed += [str(g.path) for g in cluster.cgroups.values()]
    cluster.down()
    netns.down_all(cluster.network.index)
    return [*removed, str(_state_path(name))]


def down_all() -> list[str]:
    """Remove every emulated network, CPU cgroup and cluster record of the project; idempotent.

    Returns:
        What it removed: namespaces and links, cgroup paths, record files.
    """
    removed = netns.down_all()
    removed += cg.remove_all()
    for path in sorted(STATE_DIR.glob("cluster-*.json")) if STATE_DIR.is_dir() else []:
        path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed
