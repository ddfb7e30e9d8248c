"""Turn a ``strategy`` argument (plan path, plan object, or ``{name: method}``) into per-parameter methods."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tagps.torch.ops import METHODS

__all__ = ["SyncPlan", "resolve_strategy"]


@dataclass(frozen=True)
class SyncPlan:
    """How each gradient of one model is synchronised.

    Args:
        methods: parameter name → ``allreduce``, ``ps``, ``sfb`` or ``none``.
        batch_shares: per-rank share of the global batch (``None``: taken from the optimizer's
            ``batch_share`` argument, or even).
    """

    methods: Mapping[str, str]
    batch_shares: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        bad = {n: m for n, m in self.methods.items() if m not in METHODS}
        if bad:
            name, method = next(iter(bad.items()))
            raise ValueError(
                f"strategy gives parameter {name!r} the unknown sync method {method!r}; "
                f"valid methods: {', '.join(METHODS)}"
            )
        if self.batch_shares is not None and (
            not self.batch_shares or any(not s > 0 for s in self.batch_shares)
        ):
            raise ValueError(f"batch shares must be positive numbers, got {list(self.batch_shares)}")


def _check_names(given: Sequence[str], known: Sequence[str]) -> None:
    unknown = [n for n in given if n not in set(known)]
    if unknown:
        hints = difflib.get_close_matches(unknown[0], known, n=3)
        hint = f" (did you mean {', '.join(map(repr, hints))}?)" if hints else ""
        raise ValueError(
            f"strategy names parameter {unknown[0]!r}, which the optimizer does not have{hint}; "
            f"{len(unknown)} unknown name(s) in all"
        )


def resolve_strategy(strategy: object, names: Sequence[str], default: str) -> SyncPlan:
    """Resolve ``strategy`` for the parameters ``names``, validating it before any training step.

    Args:
        strategy: ``None`` (every gradient uses ``default``); a dict ``{param_name: method}`` with an
            optional ``"default"`` entry; a plan object or a path to a plan file (``tagps.strategy.plan``).
        names: the optimizer's parameter names (from ``named_parameters``).
        default: the method for parameters the strategy does not mention.

    Raises:
        ValueError: a name the optimizer does not have, or an unknown method.
        TypeError: a strategy of another type.
    """
    if strategy is None:
        return SyncPlan({n: default for n in names})
    if isinstance(strategy, Mapping) and all(isinstance(v, str) for v in strategy.values()):
        methods = {str(k): str(v) for k, v in strategy.items()}
        fallback = methods.pop("default", default)
        _check_names(list(methods), names)
        SyncPlan({"default": fallback})  # validates the default's method
        return SyncPlan({n: methods.get(n, fallback) for n in names})
    from tagps.strategy import plan as plan_ir

    if not isinstance(strategy, str | os.PathLike | Mapping | plan_ir.Plan):
        raise TypeError(
            f"strategy must be None, a dict {{param_name: method}}, a plan or a plan path; "
            f"got {type(strategy).__name__}"
        )
    plan = plan_ir.load(strategy)
    if plan.kind != "data-parallel":
        raise ValueError(
            f"the runtime executes data-parallel plans (every op group on the same devices); this plan "
            f"is {plan.kind!r}: make it with the runtime-executable restriction of `tagps plan`"
        )
    _check_names(list(plan.gradients), names)
    return SyncPlan(
        {n: plan.gradients[n].sync if n in plan.gradients else default for n in names},
        batch_shares=tuple(float(plan.batch_shares[d]) for d in plan.devices()),
    )
