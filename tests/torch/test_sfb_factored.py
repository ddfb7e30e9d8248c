"""SFB layers skip their weight's local gradient after the first step, with unchanged results.

One process (``world_of_one``): the rebuilt gradient is then the process's own, so a tagps run must match
plain torch exactly while the layers run :class:`_FactoredLinear`.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import tagps.torch as bps
from tagps.comm.sufficient_factors import SFBNotApplicable

STEPS = 4


class TwoCalls(nn.Module):
    """A bias-free first layer on an input without grad, and a Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5, bias=False)
        self.mid = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)
        self.tie = False  # when set, mid.weight also enters the loss outside its Linear calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.tanh(self.mid(self.inp(x))))
        y = self.out(h.unsqueeze(1)).squeeze(1)  # a 3-D input: rows are every leading index
        return y + self.mid.weight.sum() if self.tie else y


def _train(model: nn.Module, distributed: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        opt = bps.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), strategy={"default": "sfb"}
        )
    for _ in range(STEPS):
        x = torch.randn(4, 6)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt  # the optimizer keeps the layers factored while it lives


def _fresh() -> TwoCalls:
    torch.manual_seed(0)
    return TwoCalls()


def test_factored_layers_train_like_torch(world_of_one: None) -> None:
    model, opt = _train(_fresh(), distributed=True)
    reference, _ = _train(_fresh(), distributed=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    # From the second step on, every SFB layer runs the factored backward.
    out = model.mid(torch.randn(2, 5, requires_grad=True))
    assert type(out.grad_fn).__name__ == "_FactoredLinearBackward"
    assert type(model.inp(torch.randn(2, 6)).grad_fn).__name__ == "_FactoredLinearBackward"
    # The weight's post-accumulate hook, which starts its sync during backward, still fires once a pass.
    fired: list[bool] = []
    handle = model.mid.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is None))
    model.mid.weight.grad = None
    model(torch.randn(4, 6)).sum().backward()
    handle.remove()
    assert fired == [True]  # and nothing was accumulated into the weight
    opt.synchronize()
    del opt  # closing the recorder gives the layers their own forward back
    assert type(model.mid(torch.randn(2, 5)).grad_fn).__name__ == "AddmmBackward0"
    model.zero_grad()
    model(torch.randn(4, 6)).sum().backward()  # plain training again: nothing refuses the weights' gradients
    assert model.mid.weight.grad is not None


def test_factored_model_pickles_and_copies(world_of_one: None) -> None:
    model, _opt = _train(_fresh(), distributed=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for clone in (loaded, copy.deepcopy(model)):
        out = clone.mid(torch.randn(2, 5))
        assert type(out.grad_fn).__name__ == "AddmmBackward0"  # the plain nn.Linear forward
        torch.testing.assert_close(clone(torch.ones(1, 6)), model(torch.ones(1, 6)))


class LateSharer(TwoCalls):
    """From the second step on, a second Linear calls ``mid``'s weight: a sharing step 1 never saw."""

    def __init__(self) -> None:
        super().__init__()
        self.again = nn.Linear(5, 5)
        self.again.weight = self.mid.weight
        self.share = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.again(torch.tanh(self.mid(self.inp(x)))).sum(1, keepdim=True) if self.share else y


def test_a_linear_sharing_a_factored_weight_later_trains_like_torch(world_of_one: None) -> None:
    def train(distributed: bool) -> nn.Module:
        torch.manual_seed(0)
        model = LateSharer()
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: a zero
        if distributed:  # gradient (tagps, again.bias in step 1) and none (torch) leave a parameter alike
            opt = bps.DistributedOptimizer(
                opt, named_parameters=model.named_parameters(), strategy={"default": "sfb"}
            )
        torch.manual_seed(1)
        for step in range(3):
            model.share = step > 0
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
        return model

    for (name, p), q in zip(train(True).named_parameters(), train(False).parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_from_outside_after_first_step_is_refused(world_of_one: None) -> None:
    model = _fresh()
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        strategy={"default": "sfb"},
    )
    for step in range(2):
        model.tie = step == 1  # a tie the first step's check could not see
        opt.zero_grad()
        loss = model(torch.randn(4, 6)).square().mean()
        if step == 0:
            loss.backward()
            opt.step()
        else:
            with pytest.raises(SFBNotApplicable, match=r"'mid\.weight' gets gradient from outside"):
                loss.backward()
