"""The optimizer seam with apex's FusedAdam as NGC images ship it, on CPU with a stand-in.

``FakeFusedAdam`` has apex's interface and state layout: ``zero_grad(self)`` without
``set_to_none``, the step count per parameter group (``group["step"]``), per-parameter state
with only ``exp_avg``/``exp_avg_sq``. The seam must give the trainer and SNIP's statistics
torch's interface (``zero_grad(set_to_none=True)``, ``state[p]["step"]``), and fall back to
torch's AdamW when apex is installed but broken.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from megatron_snip.config import TrainingConfig
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.precision import fallbacks
from megatron_snip.snip.stats import adam_denominator
from megatron_snip.training.optim import adam_state, build_optimizer


class FakeFusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam's interface (AdamW mode), in plain PyTorch."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        assert adam_w_mode
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.set_grad_none = set_grad_none

    def zero_grad(self):  # apex: no set_to_none argument
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # apex: one count per group
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if len(st) == 0:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["exp_avg"] / (1 - b1 ** group["step"])
                v_hat = st["exp_avg_sq"] / (1 - b2 ** group["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * m_hat / (v_hat.sqrt() + group["eps"]))


def _install_apex(monkeypatch, fused_adam) -> None:
    apex = types.ModuleType("apex")
    opts = types.ModuleType("apex.optimizers")
    opts.FusedAdam = fused_adam
    apex.optimizers = opts
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", opts)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))


CUDA = torch.device("cuda")  # build_optimizer picks apex for CUDA; the stand-in runs on CPU tensors


def test_apex_fused_adam_behind_torch_interface(monkeypatch):
    _install_apex(monkeypatch, FakeFusedAdam)
    model = _model()
    opt = build_optimizer(model, TrainingConfig(), CUDA, ParallelTopology.single())
    assert isinstance(opt, FakeFusedAdam)
    w = model[0].weight
    assert adam_state(opt, w) is None
    for step in (1, 2):
        model(torch.randn(3, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # apex's own zero_grad() takes no argument
        assert w.grad is None
        _m, v, count = adam_state(opt, w)  # apex keeps no per-parameter "step"
        assert count == step
    g = torch.ones_like(w)
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    assert torch.equal(adam_denominator(opt, w, g), (v / (1 - beta2**2)).sqrt() + eps)  # SNIP's preconditioner
    model(torch.randn(3, 8)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert w.grad is not None and not w.grad.any()


@pytest.mark.parametrize("failure", [RuntimeError("apex.optimizers.FusedAdam requires cuda extensions"),
                                     OSError("libcudart.so.12: cannot open shared object file")])
def test_broken_apex_falls_back_to_torch_adamw_and_says_why(monkeypatch, failure):
    class BrokenFusedAdam(FakeFusedAdam):
        def __init__(self, *args, **kwargs):
            raise failure  # as apex does when its CUDA extension did not build or load

    _install_apex(monkeypatch, BrokenFusedAdam)
    monkeypatch.setattr(fallbacks, "_RECORDED", {})
    monkeypatch.setattr(fallbacks, "_UNLOGGED", [])
    with pytest.warns(RuntimeWarning, match="apex FusedAdam failed to load"):
        opt = build_optimizer(_model(), TrainingConfig(), CUDA, ParallelTopology.single())
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    (line,) = fallbacks.drain()
    assert type(failure).__name__ in line and str(failure) in line


def test_no_apex_uses_torch_fused_adamw(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # import apex -> ImportError
    monkeypatch.setattr(fallbacks, "_UNLOGGED", [])
    opt = build_optimizer(_model(), TrainingConfig(), CUDA, ParallelTopology.single())
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] and fallbacks.drain() == []
