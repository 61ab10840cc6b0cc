"""The Transformer Engine backend's own logic, on CPU, against a stand-in for TE.

``FakeTE`` has the parts of ``transformer_engine`` the backend touches: ``pytorch.Linear``
(a bias-free linear reading ``self.weight`` at every forward, as te.Linear does),
``pytorch.autocast(enabled, recipe, ...)`` and ``common.recipe``'s recipe classes. It records
what the backend did (modules built, recipes built, forwards and the recipe active in each),
so these tests check our wrapper - module cache, recipe and capability caching, the TP and
NVFP4 refusals, start-up checks - not TE's numerics (tests/gpu/ does that where TE runs).
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_snip.precision.backends import get_backend
from megatron_snip.precision.backends.te import TEBackend
from megatron_snip.precision.plan import GemmId, GemmPrecision, PrecisionPlan, all_gemm_ids


class FakeTE:
    """Installs stand-in ``transformer_engine`` modules into ``sys.modules`` and records calls."""

    def __init__(self) -> None:
        self.modules_built: list[torch.nn.Module] = []
        self.recipes_built: list[object] = []
        self.forward_recipes: list[object] = []
        self._active: list[object] = []
        fake = self

        class Linear(torch.nn.Module):
            def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kw):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype,
                                                             device=device))
                fake.modules_built.append(self)

            def forward(self, inp):
                fake.forward_recipes.append(fake._active[-1] if fake._active else None)
                return F.linear(inp, self.weight.to(inp.dtype))  # TE computes in the input (or autocast) dtype

        @contextlib.contextmanager
        def autocast(enabled=True, recipe=None, amax_reduction_group=None):
            fake._active.append(recipe)
            try:
                yield
            finally:
                fake._active.pop()

        def recipe_class(name):
            def init(self, **kw):
                self.kw = kw
                fake.recipes_built.append(self)
            return type(name, (), {"__init__": init})

        recipe = types.ModuleType("transformer_engine.common.recipe")
        for name in ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"):
            setattr(recipe, name, recipe_class(name))
        recipe.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
        pt = types.ModuleType("transformer_engine.pytorch")
        pt.Linear, pt.autocast = Linear, autocast
        common = types.ModuleType("transformer_engine.common")
        common.recipe = recipe
        root = types.ModuleType("transformer_engine")
        root.pytorch, root.common = pt, common
        self.sys_modules = {"transformer_engine": root, "transformer_engine.pytorch": pt,
                            "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}


@pytest.fixture
def fake_te(monkeypatch):
    fake = FakeTE()
    for name, mod in fake.sys_modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    calls = []

    def supports(self, fmt, device=None):  # the capability table is tested in test_capability.py
        calls.append((fmt, str(device)))
        return True, ""

    monkeypatch.setattr(TEBackend, "supports", supports)
    fake.capability_calls = calls
    return fake


NUMEL = {"qkv": 1, "proj": 1, "fc1": 1, "fc2": 1}  # parameter counts only feed the plan's FP4 share


def _weight(n=8, k=16):
    return torch.nn.Parameter(torch.randn(n, k, generator=torch.Generator().manual_seed(0)))


def test_same_weight_twice_reuses_its_module(fake_te):
    # The WeakKeyDictionary keyed by the weight compared tensors with == on the second lookup
    # and raised "Boolean value of Tensor with more than one value is ambiguous" at step 2.
    be, w = get_backend("te"), _weight()
    x = torch.randn(4, 16)
    for _ in range(3):
        y = be.linear(x, w, GemmPrecision.uniform("fp8"))
    assert len(fake_te.modules_built) == 1
    assert torch.equal(y, x @ w.t())
    y.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.ones(4, 8).t() @ x)  # lands on the caller's Parameter
    other = _weight()
    be.linear(x, other, GemmPrecision.uniform("fp8"))
    assert len(fake_te.modules_built) == 2


def test_recipes_built_and_capability_checked_once(fake_te):
    be, w, x = TEBackend(), _weight(), torch.randn(4, 16)
    for _ in range(3):
        for fmt in ("fp8", "mxfp8", "bf16"):
            be.linear(x, w, GemmPrecision.uniform(fmt))
    assert [type(r).__name__ for r in fake_te.recipes_built] == ["Float8CurrentScaling", "MXFP8BlockScaling"]
    assert fake_te.recipes_built[0].kw == {"fp8_format": "HYBRID"}
    assert sorted(set(fake_te.capability_calls)) == sorted(fake_te.capability_calls)  # each (format, device) once
    assert len(fake_te.capability_calls) == 3
    assert fake_te.forward_recipes[:3] == [fake_te.recipes_built[0], fake_te.recipes_built[1], None]


def test_tensor_scaled_formats_refused_on_tp_shards(fake_te):
    be, w, x = TEBackend(tp_size=2), _weight(), torch.randn(4, 16)
    reduce = lambda a: a  # noqa: E731 - stands for an all-reduce MAX over the TP group
    for fmt in ("fp8", "nvfp4"):
        with pytest.raises(ValueError, match="local amax"):
            be.linear(x.bfloat16(), w, GemmPrecision.uniform(fmt), amax_reduce=reduce)
    be.linear(x, w, GemmPrecision.uniform("mxfp8"), amax_reduce=reduce)  # block scales: no cross-shard amax
    assert len(fake_te.forward_recipes) == 1
    plan = PrecisionPlan.create({g: "bf16" for g in all_gemm_ids(1)}, step=0, policy="bf16", linear_numel=NUMEL)
    with pytest.raises(ValueError, match=r"\['fp8', 'nvfp4'\] need a whole-tensor amax across parallel.tp=2"):
        be.check_run(plan, {"bf16", "fp8", "nvfp4", "mxfp8"}, per_gemm_replans=False, activation_dtype=torch.bfloat16)
    be.check_run(plan, {"bf16", "fp8_block", "mxfp8"}, per_gemm_replans=False, activation_dtype=torch.float32)
    TEBackend(tp_size=1).check_run(plan, {"fp8"}, per_gemm_replans=False, activation_dtype=torch.float32)


def test_nvfp4_needs_bf16_inputs(fake_te):
    be, w, x = TEBackend(), _weight(), torch.randn(4, 16)
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
    from megatron_snip.training import trainer as trainer_mod

    entries = {g: "bf16" for g in all_gemm_ids(2)}
    entries[GemmId(1, "fc2", "wgrad")] = "fp8"
    mixed = PrecisionPlan.create(entries, step=0, policy="file", linear_numel=NUMEL)
    with pytest.raises(ValueError, match=r"mixes formats within linear\(s\) \[\(1, 'fc2'\)\]"):
        TEBackend().check_run(mixed, {"bf16", "fp8"}, per_gemm_replans=False, activation_dtype=torch.bfloat16)

    # Through the trainer: the capability table would refuse te on CPU first; bypass it so the
    # start-up check of the TE backend itself is what answers.
    monkeypatch.setattr(trainer_mod, "require", lambda *a, **k: None)
    cfg = load_config("launch/configs/tiny.toml", small_overrides + [
        "precision.backend=te", "snip.enabled=true", "snip.granularity=gemm", 'snip.formats=["bf16", "fp8"]',
        "snip.fp4_target=0.0"])
    with pytest.raises(ValueError, match='snip.granularity="gemm"'):
        trainer_mod.Trainer(cfg)
    assert fake_te.modules_built == []  # refused before any step
