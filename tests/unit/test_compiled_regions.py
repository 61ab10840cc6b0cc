"""training.compile (issue #24 item 1): compiled block regions and loss against eager, recompiles across
re-plans, and 20 steps of tiny compiled against eager.

Tolerances (fp32 on CPU; inductor keeps the ops but may reorder a reduction and fuse
elementwise ops, so results differ by rounding, never by math):

* a reduction of n fp32 terms summed in another order differs by at most ~n·u relative to the
  sum of magnitudes (u = 2^-24), typically √n·u. The norm's mean over D and the attention's
  softmax sums over S are such reductions; weight gradients sum over the T = B·S tokens.
  Elementwise ops contribute a few ulps each (FMA contraction, a vectorized rsqrt/exp).
* 20 training steps: the per-op difference δ ≈ √D·u ≈ 1e-6 (D = 256) enters the first
  gradient; AdamW's update m/(√v+eps) is scale-free, so a relative gradient change δ changes
  each update by about δ relative, and over 20 steps at lr ≤ 3e-3 the parameter difference
  stays ~20·δ relative. The loss then differs by ~1e-5 relative; we allow 1e-4 (5x that
  headroom for growth through the nonlinearity). A wrong region - a dropped eps, RoPE on the
  wrong half, silu on the wrong chunk - moves the first loss by more than 1e-2.
"""

from __future__ import annotations

import json
import math

import torch

from megatron_snip.config import load_config
from megatron_snip.model import compiled_regions as regions
from megatron_snip.model.rope import rope_tables
from megatron_snip.precision import fallbacks
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
U = 2.0**-24


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _compare(eager_fn, args, grad_args, rtol):
    """Forward and backward of ``eager_fn`` and its compiled graph on the same inputs; max
    differences relative to each tensor's largest magnitude, asserted <= ``rtol``."""
    outs = []
    for run in (lambda: eager_fn(*args), lambda: regions.run(eager_fn, *args)):
        y = run()
        g = torch.autograd.grad(y, grad_args, torch.ones_like(y) + 0.5 * torch.sin(torch.arange(y.numel()).view_as(y)))
        outs.append((y.detach(), *g))
    assert not regions._FAILED, regions._FAILED
    for a, b in zip(*outs):
        assert float((a - b).abs().max()) <= rtol * float(a.abs().max()), (float((a - b).abs().max()), rtol)


def test_rms_norm_compiled_matches_eager_within_its_reduction():
    torch.manual_seed(0)
    d = 64
    x = torch.randn(2, 16, d, requires_grad=True)
    w = (1 + 0.1 * torch.randn(d)).requires_grad_()
    # forward/dX: the mean over D (d·u), rsqrt and the products a few ulps; dW sums over T = 32 tokens.
    _compare(regions.rms_norm, (x, w, 1e-5), (x, w), rtol=(d + 32 + 8) * U)


def test_attention_core_and_swiglu_compiled_match_eager():
    torch.manual_seed(0)
    b, s, heads, groups, hd = 2, 16, 4, 2, 16
    qkv = torch.randn(b, s, groups * (heads // groups + 2) * hd, requires_grad=True)
    cos, sin = rope_tables(s, hd, 10000.0)
    # softmax over S keys and the P·V sum over S, and dQ/dK/dV sums over S: s·u each, a few ulps around them.
    _compare(regions.attention_core, (qkv, cos, sin, heads, groups, hd), (qkv,), rtol=(4 * s + 16) * U)
    gate_up = torch.randn(b, s, 2 * 32, requires_grad=True)
    _compare(regions.swiglu, (gate_up,), (gate_up,), rtol=16 * U)  # elementwise only: a few ulps


def test_cross_entropy_compiled_matches_eager_and_the_model_uses_it(monkeypatch):
    torch.manual_seed(0)
    t, v = 64, 320
    logits = torch.randn(t, v, requires_grad=True)
    targets = torch.randint(0, v, (t,))
    # log-sum-exp over V (v·u) and the mean over T (t·u); the gradient softmax - one-hot is
    # elementwise around the same sum over V.
    _compare(regions.cross_entropy, (logits, targets), (logits,), rtol=(v + t + 16) * U)

    from megatron_snip.model.llama import LlamaModel

    model = LlamaModel(load_config(TINY).model, vocab_size=v, seed=0)
    model.set_compile(True)
    ran = []
    monkeypatch.setattr(regions, "run", lambda fn, *args: ran.append(fn.__name__) or fn(*args))
    model.loss(logits.detach().view(4, 16, v), targets.view(4, 16))
    assert ran == ["cross_entropy"]


def test_replans_recompile_nothing(small_overrides):
    """Three re-plans (steps 1, 3, 5) switch every linear's formats; the compiled regions never
    see a precision, so no graph is compiled after the first re-plan's passes."""
    over = small_overrides + ["training.compile=true", "training.max_steps=7", "training.eval_interval=100",
                              "snip.enabled=true", "snip.warmup=1", "snip.interval=2", "snip.probe_batches=1",
                              "snip.formats=[\"fp8\", \"nvfp4\"]", "snip.fp4_target=0.5"]
    from megatron_snip.snip.controller import SnipController

    cfg = load_config(TINY, over)
    tr = Trainer(cfg)
    ctl = SnipController(cfg, tr)
    seen: dict[int, int] = {}

    class Count:
        def before_step(self, host, step):
            pass

        def after_step(self, host, step):
            seen[step] = _graphs()

    tr.fit([ctl, Count()])
    tr.logger.close()
    assert not regions._FAILED and not any("training.compile" in line for line in fallbacks.drain())
    steps = [p.step for p in tr.plan_history]
    assert steps[:2] == [0, 1] and tr.plan_history[1].hash != tr.plan_history[0].hash, steps  # a real switch
    assert seen[0] > 0  # the regions did compile
    assert seen[5] == seen[1], seen  # nothing new after the first re-plan (steps 3 and 5 re-plan too)


def test_compiled_training_follows_eager_for_20_steps_of_tiny(tmp_path):
    """20 steps of tiny (BF16 plan, fp32 on CPU, SNIP off): every logged loss within 1e-4
    relative of eager (the module docstring derives it); the final validation loss as well."""
    common = ["training.max_steps=20", "training.log_interval=1", "training.eval_interval=20",
              "training.eval_batches=2", "snip.enabled=false", "training.progress=false",
              "precision.compile_quantizers=false", f"data.cache_dir={tmp_path / 'cache'}"]
    runs = {}
    for name, compiled in (("eager", "false"), ("compiled", "true")):
        run_dir = tmp_path / name
        tr = Trainer(load_config(TINY, common + [f"training.run_dir={run_dir}", f"training.compile={compiled}"]))
        tr.fit()
        tr.logger.close()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = rows
    assert not regions._FAILED
    eager = {r["step"]: r for r in runs["eager"] if "loss" in r}
    comp = {r["step"]: r for r in runs["compiled"] if "loss" in r}
    assert sorted(eager) == sorted(comp) == list(range(1, 21))
    worst = max(abs(comp[s]["loss"] - eager[s]["loss"]) / eager[s]["loss"] for s in eager)
    assert worst <= 1e-4, worst
    assert math.isclose(comp[20]["val_loss"], eager[20]["val_loss"], rel_tol=1e-4)
