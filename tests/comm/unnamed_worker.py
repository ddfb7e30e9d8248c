"""Worker of the unnamed-key test: many unnamed sums through the summation servers, then what they left.

Run under ``bpslaunch --local W --servers S --local-size L`` with ``--cases FILE`` (``{"calls": N}``) and
``--out DIR``. Every rank writes ``DIR/rank<R>.json`` with the largest error of its sums against the exact
sum, the PS keys its service declared, the shared-memory arenas its reducer holds and the ``/dev/shm``
files of the job before shutdown.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

import tagps.torch as bps
from tagps.torch import ops


def run(case: dict[str, Any]) -> dict[str, Any]:
    bps.init()
    rank, size = bps.rank(), bps.size()
    error = 0.0
    for i in range(case["calls"]):
        x = torch.full((1000,), float(rank + i))
        expected = float(sum(r + i for r in range(size)))
        pending = bps.push_pull_async(x, average=False)  # in flight beside the next: a second key
        summed = bps.allreduce(x, op=bps.Sum)
        for out in (summed, bps.synchronize(pending)):
            error = max(error, float((out - expected).abs().max()))
    service = ops.state().ps_service()
    job_prefix = os.path.basename(service._reducer._prefix)  # this job's arenas, not other jobs'
    result = {
        "rank": rank,
        "error": error,
        "declared": sorted(service._declared),
        "arenas": sorted(service._reducer._arenas),
        "shm": sorted(f for f in os.listdir("/dev/shm") if f.startswith(job_prefix)),
    }
    bps.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(json.loads(args.cases.read_text()))
    (args.out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
