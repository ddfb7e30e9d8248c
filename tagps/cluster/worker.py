"""The worker of the demo and the end-to-end benchmark: train a registry model with a plan and time it.

Start one copy per device of the plan (``bpslaunch --local`` or :meth:`tagps.cluster.run.Cluster.run`)::

    python -m tagps.cluster.worker --model vgg-mini --plan plan.json --steps 30 --out result.json

Rank ``r`` is the plan's ``r``-th worker device (``Plan.worker_devices()``). ``--runtime tagps`` (default)
runs a data-parallel plan through ``tagps.torch.DistributedOptimizer`` (each rank trains on its batch share,
every gradient synchronised as the plan says) and a general plan through ``tagps.torch.distribute`` (op
groups on their own devices, activations crossing between them); ``--runtime ddp`` runs
``torch.nn.parallel.DistributedDataParallel`` over gloo (the all-reduce baseline; even shares only);
``--runtime horovod`` runs ``horovod.torch.DistributedOptimizer`` over gloo (Horovod's defaults; even
shares only), the job's processes joined as a Horovod job by :func:`tagps.cluster.horovod_gloo.init`.
Inputs and targets are one fixed synthetic global batch cut by the plan's shares (the same samples for every
strategy), so the loss falls as the model memorises it and the losses of different plans compare. Rank 0
writes ``{"step_times_s", "mean_step_s", "samples_per_s", "losses", "cpu_s_per_step", "page_faults_per_step",
"ps_env", ...}`` to ``--out``;
the timed steps follow ``--warmup`` untimed ones, and each timed step ends when rank 0's optimizer step
returns (training is synchronous, so that is the iteration time). ``cpu_s_per_step`` is each rank's process
CPU time per timed step: what it took from its machine's quota, beside what the simulator costs;
``page_faults_per_step`` its minor page faults per timed step (buffers faulted in afresh: ``tagps.heap``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from tagps.atomic import write_text_atomic
from tagps.cluster.experiment import PLAN_ENV_KEYS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tagps.cluster.worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="registry model (tagps.models.MODELS)")
    p.add_argument("--plan", required=True, help="plan file (tagps plan): any kind with --runtime tagps")
    p.add_argument("--runtime", choices=("tagps", "ddp", "horovod"), default="tagps")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--out", help="rank 0 writes its JSON result here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the worker; return its exit status."""
    args = _parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tagps.torch as bps
    from tagps.models import plan_optimizer
    from tagps.strategy.plan import load

    plan = load(args.plan)
    devices = plan.worker_devices()
    torch.set_num_threads(1)
    bps.init()
    rank, size = bps.rank(), bps.size()
    if size != len(devices):
        raise SystemExit(f"the plan runs on {len(devices)} devices, the job has {size} workers")
    if plan.kind == "general" and args.runtime == "tagps":
        return _train_general(args, plan)
    local_batch = plan.batch_shares[devices[rank]]
    # One global synthetic batch, cut by the plan's shares: every strategy trains on the same samples,
    # so the losses of different plans (and of DDP) are comparable step by step.
    model, global_inputs, global_targets = _setup(args, plan.batch_size)
    start = sum(plan.batch_shares[d] for d in devices[:rank])
    inputs = tuple(x[start : start + local_batch] for x in global_inputs)
    targets = global_targets[start : start + local_batch]
    optimizer = plan_optimizer(plan.optimizer, model.parameters())
    if args.runtime != "tagps" and len(set(plan.batch_shares[d] for d in devices)) != 1:
        raise SystemExit(f"--runtime {args.runtime} averages gradients evenly: give it a plan of even shares")
    hvd = None
    if args.runtime == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.runtime == "horovod":
        from tagps.cluster import horovod_gloo

        hvd = horovod_gloo.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    else:
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = bps.DistributedOptimizer(optimizer, model.named_parameters(), strategy=plan)
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            used_before = _used()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(*inputs).flatten(0, -2), targets.flatten())
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    per_step = _per_step(used_before, args.steps)
    # Global loss per step: shares-weighted mean of the local losses.
    gathered: list[tuple[list[float], tuple[float, float]] | None] = [None] * size
    dist.all_gather_object(gathered, ([local_batch * x for x in losses], per_step))
    global_losses = [sum(g[0][i] for g in gathered if g) / plan.batch_size for i in range(len(losses))]
    if rank == 0 and args.out:
        _write_result(args, plan, devices, times, global_losses, [g[1] for g in gathered if g])
    # DDP's reducer must go before the process group it uses (else its destructor can abort the process).
    del optimizer, model
    dist.barrier()
    if hvd is not None:
        hvd.shutdown()
    bps.shutdown()
    return 0


def _setup(args: argparse.Namespace, batch: int) -> tuple[Any, tuple[Any, ...], Any]:
    """The model (seed 0) and one fixed synthetic global batch (seed 1000), the same for every strategy."""
    import torch

    from tagps.models import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model(args.model)
    torch.manual_seed(1000)
    global_inputs = example_inputs(args.model, batch)
    with torch.no_grad():
        out = model(*global_inputs)
    return model, global_inputs, torch.randint(0, out.shape[-1], out.shape[:-1])


def _train_general(args: argparse.Namespace, plan: Any) -> int:
    """Train a general plan with ``tagps.torch.distribute``: each rank runs its stages on its rows."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import tagps.torch as bps
    from tagps.models import plan_optimizer

    model, global_inputs, global_targets = _setup(args, plan.batch_size)

    def loss_fn(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    dmodel = bps.distribute(model, plan, loss_fn)
    optimizer = plan_optimizer(plan.optimizer, dmodel.parameters())
    inputs, targets = dmodel.shard(global_inputs, global_targets)
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            used_before = _used()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = dmodel.train_step(inputs, targets)
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    per_step = _per_step(used_before, args.steps)
    # Each rank's loss is its share of the global mean: the global loss is their sum.
    gathered: list[tuple[list[float], tuple[float, float]] | None] = [None] * bps.size()
    dist.all_gather_object(gathered, (losses, per_step))
    global_losses = [sum(g[0][i] for g in gathered if g) for i in range(len(losses))]
    if bps.rank() == 0 and args.out:
        used = [g[1] for g in gathered if g]
        _write_result(args, plan, plan.worker_devices(), times, global_losses, used)
    del optimizer, dmodel
    bps.shutdown()
    return 0


def _used() -> tuple[float, int]:
    """This process's CPU seconds (every thread) and minor page faults so far."""
    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _per_step(before: tuple[float, int], steps: int) -> tuple[float, float]:
    """CPU seconds and minor page faults per step since ``before`` (:func:`_used`), over ``steps`` steps."""
    cpu, faults = _used()
    return (cpu - before[0]) / steps, (faults - before[1]) / steps


def _write_result(
    args: argparse.Namespace,
    plan: Any,
    devices: list[str],
    times: list[float],
    losses: list[float],
    used: list[tuple[float, float]],
) -> None:
    """Write rank 0's result; ``used`` is every rank's CPU seconds and page faults per step
    (:func:`_per_step`), in the order of ``devices``."""
    mean = statistics.mean(times)
    result = {
        "model": args.model,
        "runtime": args.runtime,
        "kind": plan.kind,
        "devices": devices,
        "batch_size": plan.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_times_s": times,
        "mean_step_s": mean,
        "median_step_s": statistics.median(times),
        "samples_per_s": plan.batch_size / mean,
        "losses": losses,
        # Each rank's process CPU seconds (all its threads) per timed step: what it took from its quota.
        "cpu_s_per_step": {d: cpu for d, (cpu, _) in zip(devices, used, strict=True)},
        "page_faults_per_step": {d: faults for d, (_, faults) in zip(devices, used, strict=True)},
        # The PS settings the job ran with (tagps.cluster.experiment.plan_env): what its plan was costed at.
        "ps_env": {k: os.environ[k] for k in PLAN_ENV_KEYS if k in os.environ},
    }
    write_text_atomic(args.out, json.dumps(result, indent=1))  # whole or absent, whatever happens next


if __name__ == "__main__":
    sys.exit(main())
