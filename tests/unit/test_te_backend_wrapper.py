"""The Transformer Engine backend's own logic, on CPU, against a stand-in for TE.

``FakeTE`` (tests/te_standin.py) has the parts of ``transformer_engine`` the backend touches
and records what the backend did (modules built, recipes built, forwards with the recipe active
and ``is_first_microbatch``), so these tests check our wrapper - module cache, recipe and
capability caching, the TP and NVFP4 refusals, start-up checks, the once-per-step weight flag -
not TE's numerics (tests/gpu/ does that where TE runs).
"""

from __future__ import annotations

import pytest
import torch
from te_standin import FakeTE

from megatron_snip.model.layers import PrecisionLinear
from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.backends.te import TEBackend
from megatron_snip.precision.gemm import AmaxReducers, quant_linear
from megatron_snip.precision.plan import GemmId, GemmPrecision, PrecisionPlan, all_gemm_ids


@pytest.fixture
def fake_te(monkeypatch):
    fake = FakeTE().install(monkeypatch.setitem)
    calls = []

    def supports(self, fmt, device=None):  # the capability table is tested in test_capability.py
        calls.append((fmt, str(device)))
        return True, ""

    monkeypatch.setattr(TEBackend, "supports", supports)
    fake.capability_calls = calls
    return fake


NUMEL = {"qkv": 1, "proj": 1, "fc1": 1, "fc2": 1}  # parameter counts only feed the plan's FP4 share


def _weight(n=32, k=64):
    return torch.nn.Parameter(torch.randn(n, k, generator=torch.Generator().manual_seed(0)))


def test_same_weight_twice_reuses_its_module(fake_te):
    # The WeakKeyDictionary keyed by the weight compared tensors with == on the second lookup
    # and raised "Boolean value of Tensor with more than one value is ambiguous" at step 2.
    be, w = get_backend("te"), _weight()
    x = torch.randn(32, 64)
    for _ in range(3):
        y = be.linear(x, w, GemmPrecision())
    assert len(fake_te.modules_built) == 1
    assert torch.equal(y, x @ w.t())
    y.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.ones(32, 32).t() @ x)  # lands on the caller's Parameter
    assert fake_te.module_kwargs == [{}]  # parallel_mode=None: TE communicates nothing, reduces no amax
    other = _weight()
    be.linear(x, other, GemmPrecision.uniform("fp8"))
    assert len(fake_te.modules_built) == 2


def test_recipes_built_and_capability_checked_once(fake_te):
    be, w, x = TEBackend(), _weight(), torch.randn(32, 64)
    for _ in range(3):
        for fmt in ("fp8", "mxfp8", "bf16"):
            be.linear(x, w, GemmPrecision.uniform(fmt))
    assert [type(r).__name__ for r in fake_te.recipes_built] == ["Float8CurrentScaling", "MXFP8BlockScaling"]
    assert fake_te.recipes_built[0].kw == {"fp8_format": "HYBRID"}
    assert sorted(set(fake_te.capability_calls)) == sorted(fake_te.capability_calls)  # each (format, device) once
    assert len(fake_te.capability_calls) == 3
    assert fake_te.forward_recipes[:3] == [fake_te.recipes_built[0], fake_te.recipes_built[1], None]


def test_tensor_scaled_formats_under_tp_need_per_shard_amax(fake_te):
    w, x = _weight(), torch.randn(32, 64)
    reduce = lambda a: a  # stands for an all-reduce MAX over the TP group
    be = TEBackend(tp_size=2, tp_amax="shard")
    for fmt in ("fp8", "nvfp4"):  # a layer asking for a whole-tensor amax of a sharded operand is refused
        with pytest.raises(ValueError, match='precision.tp_amax="shard"'):
            be.linear(x.bfloat16(), w, GemmPrecision.uniform(fmt), amax_reduce=AmaxReducers(w=reduce))
    assert fake_te.forward_recipes == []
    be.linear(x, w, GemmPrecision.uniform("mxfp8"), amax_reduce=reduce)  # block scales: no cross-shard amax
    y = be.linear(x, w, GemmPrecision.uniform("fp8"))  # per shard: TE's own (local) amaxes
    assert torch.equal(y, quant_linear(x, w, GemmPrecision.uniform("fp8")))
    assert len(fake_te.forward_recipes) == 2
    plan = PrecisionPlan.create({g: "bf16" for g in all_gemm_ids(1)}, step=0, policy="bf16", linear_numel=NUMEL)
    with pytest.raises(ValueError, match=r"\['fp8', 'nvfp4'\] have a tensor scale.*parallel.tp=2.*tp_amax=\"shard\""):
        TEBackend(tp_size=2, tp_amax="tensor").check_run(plan, {"bf16", "fp8", "nvfp4", "mxfp8"},
                                                         per_gemm_replans=False, activation_dtype=torch.bfloat16)
    TEBackend(tp_size=2, tp_amax="tensor").check_run(plan, {"bf16", "fp8_block", "mxfp8"}, per_gemm_replans=False,
                                                     activation_dtype=torch.float32)
    be.check_run(plan, {"bf16", "fp8", "nvfp4"}, per_gemm_replans=False, activation_dtype=torch.bfloat16)
    TEBackend(tp_size=1).check_run(plan, {"fp8"}, per_gemm_replans=False, activation_dtype=torch.float32)


def _train_micro_batches(lin, n, seed):
    """One step's scope with ``n`` micro-batches through ``lin``, then an in-place "optimizer" update."""
    g = torch.Generator().manual_seed(seed)
    lin.weight_copy.open()
    try:
        for _ in range(n):
            lin(torch.randn(32, 64, generator=g)).sum().backward()
    finally:
        lin.weight_copy.close()
    with torch.no_grad():
        lin.weight.mul_(0.5)  # the weight changes between steps (bumps its version)


def test_weight_quantized_once_per_step(fake_te):
    """is_first_microbatch: True at a step's first micro-batch, False after; None outside a step
    (no_grad evaluation); a re-plan to another quantized format gets a new module, a BF16 probe
    in between its own. The stand-in raises if a False would reuse a stale kept weight."""
    lin = PrecisionLinear(64, 32, layer=0, linear="qkv", init_std=0.02)
    lin.backend = TEBackend()
    lin.set_precision(GemmPrecision.uniform("fp8"))
    _train_micro_batches(lin, 3, seed=1)
    _train_micro_batches(lin, 2, seed=2)
    assert fake_te.first_microbatch_flags == [True, False, False, True, False]
    with torch.no_grad():
        lin(torch.randn(32, 64))
    assert fake_te.first_microbatch_flags[-1] is None
    lin.set_precision(GemmPrecision.uniform("mxfp8"))  # a re-plan
    lin.weight_copy.open()
    lin(torch.randn(32, 64)).sum().backward()
    lin.local_gemm(torch.randn(32, 64), GemmPrecision()).sum().backward()  # a BF16 probe
    lin(torch.randn(32, 64)).sum().backward()
    lin.weight_copy.close()
    assert fake_te.first_microbatch_flags[-3:] == [True, True, False]
    assert len(fake_te.modules_built) == 3  # fp8, then mxfp8 replacing it; bf16 apart
    assert len(lin.backend._modules) == 2
    # Without the scope's flags a stale kept weight would be reused: the stand-in catches it.
    with torch.no_grad():
        lin.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="would reuse a kept weight"):
        lin.backend.linear(torch.randn(32, 64), lin.weight, lin.precision, is_first_microbatch=False)


def test_nvfp4_needs_bf16_inputs(fake_te):
    be, w, x = TEBackend(), _weight(), torch.randn(32, 64)
    with pytest.raises(ValueError, match="bf16 inputs only"):
        be.linear(x, w, GemmPrecision.uniform("nvfp4"))
    assert fake_te.forward_recipes == []  # refused before TE is reached
    be.linear(x.bfloat16(), w, GemmPrecision.uniform("nvfp4"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # TE casts to the autocast dtype itself
        be.linear(x, w, GemmPrecision.uniform("nvfp4"))
    assert len(fake_te.forward_recipes) == 2
    plan = PrecisionPlan.create({g: "bf16" for g in all_gemm_ids(1)}, step=0, policy="bf16", linear_numel=NUMEL)
    with pytest.raises(ValueError, match='training.dtype="bfloat16"'):
        be.check_run(plan, {"bf16", "nvfp4"}, per_gemm_replans=False, activation_dtype=torch.float32)


def test_per_gemm_plans_refused_at_start_up(fake_te, monkeypatch, small_overrides):
    from megatron_snip.config import load_config
    from megatron_snip.training import resolve as resolve_mod
    from megatron_snip.training import trainer as trainer_mod

    entries = {g: "bf16" for g in all_gemm_ids(2)}
    entries[GemmId(1, "fc2", "wgrad")] = "fp8"
    mixed = PrecisionPlan.create(entries, step=0, policy="file", linear_numel=NUMEL)
    with pytest.raises(ValueError, match=r"mixes formats within linear\(s\) \[\(1, 'fc2'\)\]"):
        TEBackend().check_run(mixed, {"bf16", "fp8"}, per_gemm_replans=False, activation_dtype=torch.bfloat16)

    # Through the trainer: the capability table would refuse te on CPU first; bypass it so the
    # start-up check of the TE backend itself is what answers.
    monkeypatch.setattr(resolve_mod, "require", lambda *a, **k: None)
    cfg = load_config("launch/configs/tiny.toml", small_overrides + [
        "precision.backend=te", "snip.enabled=true", "snip.granularity=gemm", 'snip.formats=["bf16", "fp8"]',
        "snip.fp4_target=0.0"])
    with pytest.raises(ValueError, match='snip.granularity="gemm"'):
        trainer_mod.Trainer(cfg)
    assert fake_te.modules_built == []  # refused before any step


def test_trainer_applies_tp_amax_to_the_model_and_te(fake_te, monkeypatch, small_overrides):
    from megatron_snip.config import load_config
    from megatron_snip.model.llama import LlamaModel
    from megatron_snip.training import resolve as resolve_mod
    from megatron_snip.training import trainer as trainer_mod

    modes = []
    real = LlamaModel.set_tp_amax
    monkeypatch.setattr(LlamaModel, "set_tp_amax", lambda self, mode: modes.append(mode) or real(self, mode))
    monkeypatch.setattr(resolve_mod, "require", lambda *a, **k: None)  # TE's capability table: not on CPU
    cfg = load_config("launch/configs/tiny.toml", small_overrides + ["precision.backend=te", "precision.tp_amax=shard"])
    t = trainer_mod.Trainer(cfg)
    assert modes == ["shard"]
    lin = next(t.model.precision_linears())
    assert isinstance(lin.backend, TEBackend) and lin.backend.tp_amax == "shard"
