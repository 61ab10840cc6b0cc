"""Tensor scales under TP=2 on 2 gloo ranks (``precision.tp_amax``), fp32.

* ``"shard"``: each linear's local outputs and gradients equal a dense reference built shard by
  shard in one process - each shard's GEMMs run by ``quant_linear`` on the full weight's slice
  with local amaxes, the partial results summed - bit for bit: the TP layer runs the same
  quantized GEMMs on the same tensors, and a sum of two partials is exact whatever the order
  (floating-point addition of two terms is commutative). With every weight's second TP half
  scaled 8x the per-shard results must differ from ``"tensor"``'s (the test can see the mode).
* ``"tensor"``: skipping the replicated operands' reductions (column-parallel X, row-parallel dY;
  also under sequence parallelism, where they are gathered before they are quantized) gives the
  bits of reducing every operand, with the collectives counted: 2 per linear per micro-batch for
  fp8 and 3 for nvfp4-sr (its wgrad operands are rotated, so their amaxes are new), where every
  operand of every GEMM took one before (6). The inputs' and upstream gradients' second sequence
  halves are scaled 8x, so a sharded operand treated as replicated would change the bits.
* The te backend on the TE stand-in (tests/te_standin.py: TE's per-module semantics, local amaxes)
  equals the emulated backend with ``tp_amax="shard"`` on a whole TP=2 model, losses and
  gradients bitwise, over two micro-batches whose weights TE is told to quantize once.
* SNIP's measured GEMMs (``snip.measure.quantized_gemms`` on the layer's X and dY) are the layer's
  own per-shard GEMMs, bit for bit.
"""

from __future__ import annotations

import operator

import pytest
import torch
from dist_harness import run_ranks

from megatron_snip.config import ModelConfig
from megatron_snip.model.layers import shard_tensor
from megatron_snip.model.llama import LlamaModel
from megatron_snip.parallel import comm
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.precision.gemm import AmaxReducers, quant_linear
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.snip.measure import quantized_gemms

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2)
VOCAB, B, S = 320, 2, 32
FORMATS = ("fp8", "nvfp4-sr")  # nvfp4 without SR: deterministic, so shards can match bit for bit


def _models(topo, sequence_parallel):
    torch.manual_seed(11)
    full = LlamaModel(CFG, VOCAB)
    torch.manual_seed(11)
    tp = LlamaModel(CFG, VOCAB, tp=topo.tensor_parallel(sequence_parallel))
    pairs = []
    with torch.no_grad():
        for f, p in zip(full.precision_linears(), tp.precision_linears()):
            column = p.shard_dim == 0
            n = f.weight.shape[0 if column else 1] // (2 * f.partitions)
            for part in range(f.partitions):  # the second TP half of each partition 8x: shard amaxes differ
                lo = part * 2 * n + n
                (f.weight[lo:lo + n] if column else f.weight[:, lo:lo + n]).mul_(8.0)
            p.weight.copy_(p.shard(f.weight))
            pairs.append((f, p, column))
    return full, tp, pairs


def _inputs(full_lin, seed):
    g = torch.Generator().manual_seed(seed)
    n, k = full_lin.global_shape
    x, up = torch.randn(B, S, k, generator=g), torch.randn(B, S, n, generator=g)
    x[:, S // 2:] *= 8.0  # sequence halves differ: a sequence shard's amax is not the whole tensor's
    up[:, S // 2:] *= 8.0
    return x, up


def _grads(fn, x, w, up):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(up)
    return y.detach(), x.grad, w.grad


def _seq(t, rank, sp):
    """The rank's sequence shard of a (B, S, ·) tensor under sequence parallelism, else t."""
    return shard_tensor(t, 1, 2, rank) if sp else t


def _run_layer(p, x, up, rank, sp, column):
    """The TP layer's local (y, dx, dw) for the full input x and upstream gradient up."""
    if column:
        x_in, up_in = _seq(x, rank, sp), shard_tensor(up, 2, 2, rank, p.partitions)
    else:
        x_in, up_in = shard_tensor(x, 2, 2, rank), _seq(up, rank, sp)
    x_in = x_in.detach().clone().requires_grad_(True)
    y = p(x_in)
    y.backward(up_in)
    dw, p.weight.grad = p.weight.grad, None
    return y.detach(), x_in.grad, dw


def _dense_per_shard(f, x, up, prec, rank, sp, column):
    """What the TP layer must return on ``rank``, built from the full weight one shard at a time."""
    linear = lambda a, w: quant_linear(a, w, prec)  # local amaxes: per shard
    parts = []
    for r in range(2):
        if column:
            w = shard_tensor(f.weight, 0, 2, r, f.partitions)
            parts.append(_grads(linear, x, w, shard_tensor(up, 2, 2, r, f.partitions)))
        else:
            parts.append(_grads(linear, shard_tensor(x, 2, 2, r), shard_tensor(f.weight, 1, 2, r), up))
    (y0, dx0, _), (y1, dx1, _) = parts
    if column:  # output columns are local; dX partials summed over TP (then sequence-scattered under SP)
        return (parts[rank][0], _seq(dx0 + dx1, rank, sp), parts[rank][2]), parts[rank]
    return (_seq(y0 + y1, rank, sp), parts[rank][1], parts[rank][2]), parts[rank]


def _count_all_reduce_max(calls: list[int]):
    """Count every ``comm.all_reduce_max`` (the TP amax reducers look it up at call time); returns the original."""
    real = comm.all_reduce_max

    def counted(t, group):
        calls.append(1)
        return real(t, group)

    comm.all_reduce_max = counted
    return real


def _worker(rank: int, world: int, sp: bool) -> dict:
    topo = init_distributed(tp=2, pp=1, device_type="cpu", timeout_s=60)
    _, _, pairs = _models(topo, sp)
    out = {"shard_differs": [], "counts": {}}
    calls: list[int] = []
    real_all_reduce_max = _count_all_reduce_max(calls)
    for fmt in FORMATS:
        prec = GemmPrecision.uniform(fmt)
        for i, (f, p, column) in enumerate(pairs[:4]):  # block 0's qkv, proj, fc1, fc2
            p.set_precision(prec)
            label = f"{fmt} {p.linear} sp={sp}"
            x, up = _inputs(f, 100 + i)
            # "shard" against the dense per-shard reference, bit for bit
            p.set_tp_amax("shard")
            calls.clear()
            got = _run_layer(p, x, up, rank, sp, column)
            assert not calls, f"{label}: per-shard scaling ran {len(calls)} amax collectives"
            want, own = _dense_per_shard(f, x, up, prec, rank, sp, column)
            for name, a, b in zip(("y", "dx", "dw"), got, want):
                assert torch.equal(a, b), f"{label} shard {name}: max diff {(a - b).abs().max()}"
            # SNIP measures this rank's GEMMs the same way (its quantized_gemms on the layer's X and dY)
            x_loc = x if column else shard_tensor(x, 2, 2, rank)
            g_loc = shard_tensor(up, 2, 2, rank, p.partitions) if column else up
            measured = quantized_gemms(p, x_loc.reshape(-1, x_loc.shape[-1]), g_loc.reshape(-1, g_loc.shape[-1]), prec)
            for name, a, b in zip(("y", "dx", "dw"), measured, own):
                assert torch.equal(a, b.reshape(a.shape)), f"{label} SNIP's measured {name} is not the layer's GEMM"
            # "tensor": replicated operands skipped - the bits of reducing every operand, fewer collectives
            p.set_tp_amax("tensor")
            calls.clear()
            skipped = _run_layer(p, x, up, rank, sp, column)
            out["counts"][label] = len(calls)
            p.amax_reduce = AmaxReducers.of(comm.amax_reducer(topo.tp_group))  # every operand reduced
            calls.clear()
            every = _run_layer(p, x, up, rank, sp, column)
            out["counts"][label + " every"] = len(calls)
            p.set_tp_amax("tensor")
            for name, a, b in zip(("y", "dx", "dw"), skipped, every):
                assert torch.equal(a, b), f"{label} tensor {name}: skipping replicated amaxes changed the bits"
            if any(not torch.equal(a, b) for a, b in zip(got, skipped)):
                out["shard_differs"].append(label)
            p.set_precision(GemmPrecision())
    comm.all_reduce_max = real_all_reduce_max
    out["te"] = _te_matches_emulated(topo, sp)
    return out


def _te_matches_emulated(topo, sp) -> dict:
    """The whole TP=2 model, fp8 everywhere, two micro-batches: te (stand-in) vs emulated "shard"."""
    from te_standin import FakeTE

    from megatron_snip.precision.backends import get_backend
    from megatron_snip.precision.backends.te import TEBackend

    fake = FakeTE().install(operator.setitem)
    TEBackend.supports = lambda self, fmt, device=None: (True, "")  # the capability table is tested elsewhere
    tokens = torch.randint(0, VOCAB, (2, B, S + 1), generator=torch.Generator().manual_seed(9))
    results = []
    for backend in (get_backend("emulated"), TEBackend(tp_size=2, tp_amax="shard")):
        _, model, _ = _models(topo, sp)
        model.set_backend(backend)
        model.set_tp_amax("shard")
        for lin in model.precision_linears():
            lin.set_precision(GemmPrecision.uniform("fp8"))
        losses = []
        with model.weight_copies_for_step():
            for mb in tokens:
                loss = model.loss(model(mb[:, :-1]), mb[:, 1:])
                loss.backward()
                losses.append(loss.detach())
        results.append((losses, {n: q.grad.clone() for n, q in model.named_parameters()}))
    (l_emu, g_emu), (l_te, g_te) = results
    assert all(torch.equal(a, b) for a, b in zip(l_emu, l_te)), (l_emu, l_te)
    bad = [n for n in g_emu if not torch.equal(g_emu[n], g_te[n])]
    assert not bad, f"te stand-in vs emulated shard: gradients differ in {bad}"
    return {"flags": fake.first_microbatch_flags, "modules": len(fake.modules_built),
            "module_kwargs": fake.module_kwargs[0]}


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_amax_modes(sp):
    res = run_ranks(_worker, 2, args=(sp,), timeout_s=240)
    for r in res:
        for fmt, n_new in (("fp8", 2), ("nvfp4-sr", 3)):
            for linear in ("qkv", "proj", "fc1", "fc2"):
                label = f"{fmt} {linear} sp={sp}"
                # every operand reduced: once per tensor (X, W, dY) plus nvfp4's 2 rotated wgrad operands
                assert r["counts"][label + " every"] == (3 if fmt == "fp8" else 5), (label, r["counts"])
                assert r["counts"][label] == n_new, (label, r["counts"])
                assert label in r["shard_differs"], f"{label}: per-shard and whole-tensor scaling agree - no teeth"
        te = r["te"]
        assert te["modules"] == 8 and te["module_kwargs"] == {}  # a te.Linear per linear, parallel_mode=None
        assert te["flags"] == [True] * 8 + [False] * 8  # each weight quantized at the first micro-batch only
