"""Synthetic-data training benchmark, flag-compatible with Horovod's ``pytorch_synthetic_benchmark.py``.

Runs unchanged under ``bpslaunch``, e.g.::

    bpslaunch --local 2 --servers 1 -- python examples/train_synthetic.py --model vgg19 --batch-size 8 \\
        --image-size 32 --strategy allreduce:sfb

Beyond Horovod's flags: ``--strategy`` (``auto``; ``allreduce``/``ps``, optionally ``:sfb`` for every
``nn.Linear`` weight; or a JSON file with a ``{param: method}`` dict or a plan), ``--image-size``,
``--num-threads``, ``--ddp`` (the same loop with ``torch.nn.parallel.DistributedDataParallel`` over gloo,
the baseline), ``--horovod`` (the same loop on ``horovod.torch``, started by ``horovodrun``) and
``--json FILE`` (rank 0 writes the measured figures). Models come from
:mod:`tagps.models`; a VGG at an image size other than 224 gets its first classifier layer resized to the
feature map it sees (its 4096-wide fully connected layers are kept).
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tagps.torch as hvd
from tagps.models import build_model, model_spec
from tagps.models.cnn import VGG


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="tagps synthetic benchmark", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    p.add_argument("--model", default="resnet101", help="model to benchmark (a tagps.models name)")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    p.add_argument("--no-cuda", action="store_true", help="disable CUDA training")
    p.add_argument("--use-adasum", action="store_true", help="use adasum algorithm (not supported by tagps)")
    p.add_argument("--image-size", type=int, default=224, help="height and width of the synthetic images")
    p.add_argument("--strategy", default="auto", help="auto | allreduce | ps, optionally ':sfb' | FILE.json")
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--ddp", action="store_true", help="baseline: DistributedDataParallel over gloo, no tagps")
    p.add_argument("--json", type=Path, help="rank 0 writes the results here")
    p.add_argument("--horovod", action="store_true", help="run on horovod.torch instead (a baseline)")
    args = p.parse_args()
    if args.use_adasum:
        p.error("--use-adasum: tagps has no Adasum; it sums or averages gradients")
    for flag in ("batch_size", "num_batches_per_iter", "num_iters", "image_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def make_model(name: str, image_size: int) -> nn.Module:
    """Build ``name``; a VGG's first classifier layer is resized to the features of ``image_size`` images."""
    model_spec(name)  # a clear error for an unknown name
    model = build_model(name)
    if isinstance(model, VGG) and image_size != 224:
        with torch.no_grad():
            features = model.features(torch.zeros(1, 3, image_size, image_size)).numel()
        first = model.classifier[1]
        assert isinstance(first, nn.Linear)
        model.classifier[1] = nn.Linear(features, first.out_features)
    return model


def make_strategy(spec: str, model: nn.Module) -> Any:
    """Turn ``--strategy`` into what ``DistributedOptimizer(strategy=...)`` takes."""
    if spec == "auto":
        return None
    if spec.endswith(".json"):
        return json.loads(Path(spec).read_text())
    default, _, linear = spec.partition(":")
    if default not in ("allreduce", "ps") or linear not in ("", "sfb"):
        raise SystemExit(
            f"--strategy {spec!r}: expected auto, allreduce, ps, allreduce:sfb, ps:sfb or FILE.json"
        )
    strategy = {"default": default}
    if linear:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                strategy[f"{name}.weight"] = "sfb"
    return strategy


def main() -> None:
    args = parse_args()
    if args.horovod:
        import horovod.torch  # the import a user changes to switch frameworks

        train(args, horovod.torch)
    else:
        train(args, hvd)


def train(args: argparse.Namespace, hvd: Any) -> None:
    """Horovod's benchmark loop on ``hvd`` (``tagps.torch`` or ``horovod.torch``)."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(1234)
    model = make_model(args.model, args.image_size).to(device)
    model.eval()
    with torch.no_grad():
        classes = model(torch.zeros(2, 3, args.image_size, args.image_size, device=device)).shape[-1]
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    if args.ddp:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        method = "ddp"
    else:
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        extra = {} if args.horovod else {"strategy": make_strategy(args.strategy, model)}
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression, **extra
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        method = "horovod" if args.horovod else args.strategy
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, classes, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}, image size {args.image_size}, batch size {args.batch_size}, method {method}")
    log(f"Number of {'GPU' if cuda else 'CPU'} workers: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for i in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{i}: {img_sec:.1f} img/sec per worker")
        img_secs.append(img_sec)
    mean = sum(img_secs) / len(img_secs)
    spread = 1.96 * (sum((x - mean) ** 2 for x in img_secs) / len(img_secs)) ** 0.5
    log(f"Img/sec per worker: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
    total = hvd.allreduce(torch.tensor([mean], dtype=torch.float64), op=hvd.Sum).item()
    if args.json is not None and hvd.rank() == 0:
        args.json.write_text(
            json.dumps(
                {"model": args.model, "method": method, "workers": hvd.size(), "batch_size": args.batch_size,
                 "samples_per_s": total, "per_worker_samples_per_s": img_secs}
            )
        )  # fmt: skip
    hvd.shutdown()


if __name__ == "__main__":
    main()
