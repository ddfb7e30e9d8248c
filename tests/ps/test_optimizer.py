"""Server-side optimizers give torch.optim's numbers (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tagps.config import ServerOptimizerConfig
from tagps.ps.optimizer import ServerOptimizer

CASES = [
    (ServerOptimizerConfig("sgd", lr=0.1), torch.optim.SGD, {"lr": 0.1}),
    (
        ServerOptimizerConfig("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    (
        ServerOptimizerConfig("adam", lr=0.01, amsgrad=True, maximize=True),
        torch.optim.Adam,
        {"lr": 0.01, "amsgrad": True, "maximize": True},
    ),
    (
        ServerOptimizerConfig("adamw", lr=0.01, weight_decay=0.01),
        torch.optim.AdamW,
        {"lr": 0.01, "weight_decay": 0.01},
    ),
    (
        ServerOptimizerConfig("rmsprop", lr=0.01, momentum=0.5, centered=True),
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.5, "centered": True},
    ),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("config", "torch_cls", "kwargs"), CASES, ids=lambda c: getattr(c, "name", ""))
def test_server_optimizer_matches_torch(config: ServerOptimizerConfig, torch_cls, kwargs, dtype) -> None:
    rng = np.random.default_rng(0)
    init = rng.standard_normal(1031).astype(dtype)
    grads = [rng.standard_normal(1031).astype(dtype) for _ in range(4)]
    optimizer = ServerOptimizer(config)
    state = optimizer.new_state(init.size, init.dtype)
    param = init.copy()
    reference = torch.nn.Parameter(torch.from_numpy(init.copy()))
    torch_opt = torch_cls([reference], **kwargs)
    for grad in grads:
        optimizer.step(param, grad, state)
        reference.grad = torch.from_numpy(grad.copy())
        torch_opt.step()
    np.testing.assert_allclose(param, reference.detach().numpy(), rtol=1e-6, atol=1e-7)
    assert state.step == len(grads)


def test_server_optimizer_needs_a_name() -> None:
    with pytest.raises(ValueError, match="TAGPS_SERVER_OPTIMIZER"):
        ServerOptimizer(ServerOptimizerConfig())
