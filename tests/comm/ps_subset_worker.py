"""Worker of the ps-subset tests: sums over subsets of the job's ranks next to a sum over every rank.

Run under ``bpslaunch --local W --servers S --local-size L`` with ``--cases FILE`` (a JSON object) and
``--out DIR``. The case lists ``subsets`` (rank lists; every rank constructs each, in order) and ``refused``
(rank lists whose construction must raise ValueError on every rank). Every rank writes ``DIR/rank<R>.json``
with the largest error of each of its sums against the exact sum and the messages of the refusals.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import tagps.torch as bps
from tagps.torch import ops

SIZES = (1, 7, 5000)  # 5000 float32 elements span several chunks of BYTEPS_PARTITION_BYTES=4096
ROUNDS = 3


def value(rank: int, rnd: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct small integers per rank and round: every sum is exact in float32 and float64."""
    return (torch.arange(n) % 97 + 1000 * (rank + 1) + 10 * rnd).to(dtype)


def run(case: dict[str, Any]) -> dict[str, Any]:
    bps.init()
    rank, size = bps.rank(), bps.size()
    service = ops.state().ps_service()
    refused = []
    for ranks in case.get("refused", []):
        try:
            service.subset(ranks)
        except ValueError as exc:
            refused.append(str(exc))
        else:
            refused.append(None)
    subsets = [service.subset(ranks) for ranks in case["subsets"]]
    # A second call for the same ranks (in any order) returns the same subset and creates nothing.
    cached = all(service.subset(list(reversed(s.ranks))) is s for s in subsets)
    # (service, name, members) of every sum this rank takes part in; the full sum last, so that it runs
    # while the subsets' sums are in flight.
    sums = [(s, f"s{i}", s.ranks) for i, s in enumerate(subsets) if rank in s.ranks]
    sums.append((service, "all", tuple(range(size))))
    errors: dict[str, float] = {}
    for rnd in range(ROUNDS):
        works = []
        for svc, name, members in sums:
            for n in SIZES:
                for dtype in (torch.float32, torch.float64):
                    key = f"{name}.{n}.{str(dtype)[6:]}"
                    tensor = value(rank, rnd, n, dtype)
                    expected = sum(value(r, rnd, n, dtype) for r in members)
                    works.append((key, tensor, expected, svc.push_pull_async(key, tensor, priority=n)))
        for key, tensor, expected, work in works:
            work.wait()
            errors[key] = max(errors.get(key, 0.0), float((tensor - expected).abs().max()))
    bps.shutdown()
    return {"rank": rank, "errors": errors, "refused": refused, "cached": cached}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(json.loads(args.cases.read_text()))
    (args.out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
