"""tagps: topology-aware graph deployment (TAG) on a BytePS-style communication runtime."""

import sys
from typing import Any

__version__ = "0.1.0"

__all__ = ["DistributedOptimizer", "__version__"]


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrap a framework optimizer so each gradient is synchronised by its strategy's method.

    The framework is recognised from ``optimizer``; a torch optimizer goes to
    :func:`tagps.torch.DistributedOptimizer` (same arguments), after :func:`tagps.torch.init` if the script
    did not call it. Other frameworks plug in here.

    Raises:
        TypeError: no adapter for this kind of optimizer.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(optimizer, torch.optim.Optimizer):
        import tagps.torch

        tagps.torch.init()
        return tagps.torch.DistributedOptimizer(optimizer, *args, **kwargs)
    raise TypeError(
        f"no tagps adapter for a {type(optimizer).__module__}.{type(optimizer).__name__}: "
        "tagps.DistributedOptimizer wraps torch.optim.Optimizer instances"
    )
