"""The optimizer seam: torch's fused AdamW on CUDA (its ``found_inf`` skips on the device), the
foreach AdamW on CPU, and the fused kernel's numerics against the foreach reference.

PyTorch's fused AdamW also runs on CPU, so its numerics and its ``found_inf`` input are tested
here on CPU tensors; ``build_optimizer`` is asked for a CUDA optimizer with CPU parameters (the
constructor does not care where the parameters live).
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from megatron_snip.config import TrainingConfig
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.snip.adam_moments import adam_denominator, adam_steps
from megatron_snip.telemetry.host_syncs import count_host_syncs
from megatron_snip.training.optim import adam_state, build_optimizer
from megatron_snip.training.step_guard import optimizer_step, takes_found_inf

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))


def test_cuda_takes_torch_fused_adamw_even_with_apex_installed(monkeypatch):
    apex = types.ModuleType("apex")  # an NGC image's apex: no longer chosen (it cannot skip on the device)
    apex.optimizers = types.SimpleNamespace(FusedAdam=object)
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", apex.optimizers)
    opt = build_optimizer(_model(), TrainingConfig(), CUDA, ParallelTopology.single())
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] and takes_found_inf(opt)
    cpu = build_optimizer(_model(), TrainingConfig(), CPU, ParallelTopology.single())
    assert cpu.defaults["foreach"] and not takes_found_inf(cpu)


def _train(opt: torch.optim.Optimizer, model: nn.Module, skips: list[bool]) -> None:
    gen = torch.Generator().manual_seed(5)
    for skip in skips:
        x = torch.randn(3, 8, generator=gen)
        model(x).pow(2).sum().backward()
        optimizer_step(opt, torch.tensor(1.0 if skip else 0.0))
        opt.zero_grad(set_to_none=True)


def test_fused_adamw_matches_the_foreach_reference_and_skips_on_the_device():
    skips = [False, False, True, False, False, True]
    fused_model, ref_model = _model(), _model()
    fused = build_optimizer(fused_model, TrainingConfig(), CUDA, ParallelTopology.single())
    ref = build_optimizer(ref_model, TrainingConfig(), CPU, ParallelTopology.single())
    with count_host_syncs() as fused_syncs:
        _train(fused, fused_model, skips)
    with count_host_syncs() as ref_syncs:
        _train(ref, ref_model, skips)
    assert fused_syncs.count == 0, fused_syncs.where  # found_inf: decided on the device
    assert ref_syncs.count == len(skips), ref_syncs.where  # one read of the flag per step
    # The same update, summed in another order: each step moves a weight by at most lr (Adam's
    # normalized step, |m̂/√v̂| <= 1 here) plus decay, rounded once per operation in fp32, so the two
    # paths drift apart by a few ulps of |w| per step; 8 ulps per applied step bounds it.
    applied = skips.count(False)
    for pf, pr in zip(fused_model.parameters(), ref_model.parameters()):
        tol = 8 * applied * torch.finfo(torch.float32).eps * max(1.0, float(pr.detach().abs().max()))
        assert (pf - pr).abs().max() <= tol
        (mf, vf, nf), (mr, vr, nr) = adam_state(fused, pf), adam_state(ref, pr)
        assert nf == nr == applied  # skipped steps advanced no step count
        assert torch.allclose(mf, mr, rtol=1e-5, atol=1e-7) and torch.allclose(vf, vr, rtol=1e-5, atol=1e-9)


def test_a_skipped_fused_step_leaves_weights_and_moments_untouched():
    model = _model()
    opt = build_optimizer(model, TrainingConfig(), CUDA, ParallelTopology.single())
    _train(opt, model, [False, False])
    before = [(p.detach().clone(), *(t.clone() for t in adam_state(opt, p)[:2])) for p in model.parameters()]
    _train(opt, model, [True])
    for p, (w, m, v) in zip(model.parameters(), before):
        m1, v1, n1 = adam_state(opt, p)
        assert torch.equal(p, w) and torch.equal(m1, m) and torch.equal(v1, v) and n1 == 2


def test_snip_reads_the_fused_step_counts_once():
    model = _model()
    opt = build_optimizer(model, TrainingConfig(), CUDA, ParallelTopology.single())
    _train(opt, model, [False, False])
    params = list(model.parameters())
    with count_host_syncs() as syncs:
        steps = adam_steps(opt, params)
    assert syncs.count == 1 and set(steps.values()) == {2.0}
    w = model[0].weight
    _m, v, _n = adam_state(opt, w)
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    expected = (v / (1 - beta2**2)).sqrt() + eps  # SNIP's preconditioner, bias-corrected
    assert torch.equal(adam_denominator(opt, w, torch.ones_like(w), steps[id(w)]), expected)
    assert torch.equal(adam_denominator(opt, w, torch.ones_like(w)), expected)


def test_the_with_probe_preconditioner_is_the_one_adamw_divides_its_next_update_by():
    """snip.preconditioner="with_probe": adam_denominator(with_grad=True) before a step equals √v̂ + eps
    read from AdamW's state after that step with the same gradient (its v and step count); a
    gradient 10^4 above v's history stays bounded by 1/√(1-β2) per element, where "stored" is not."""
    model = _model()
    opt = build_optimizer(model, TrainingConfig(), CPU, ParallelTopology.single())
    _train(opt, model, [False, False])
    w = model[0].weight
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * 1e4  # a spike
    predicted = adam_denominator(opt, w, grad, with_grad=True)
    stored = adam_denominator(opt, w, grad)
    for p in model.parameters():
        p.grad = grad.clone() if p is w else torch.zeros_like(p)
    opt.step()
    _m, v, n = adam_state(opt, w)
    after = (v / (1 - beta2**n)).sqrt() + eps
    # The same two fp32 roundings (v·β2, + (1-β2)·g²) in either order or fused, then the bias
    # correction and sqrt: within a few ulps of the result; 8 ulps bounds it.
    assert torch.allclose(predicted, after, rtol=8 * torch.finfo(torch.float32).eps, atol=0)
    bound = 1 / (1 - beta2) ** 0.5
    assert float((grad / predicted).abs().max()) <= bound
    assert float((grad / stored).abs().max()) > 100 * bound
