"""Model (single process): layout-independent init, TP shard/unshard, fused layouts, old API.

Tensor-parallel shards are built here as ``TensorParallel(group=None, size=2, rank=r)``: the
shapes, slicing and init of a TP=2 rank without any communication, so the layouts can be
checked against the unsharded model in one process. The communicating equivalence tests
(TP=2 vs TP=1 forward/backward) are in tests/distributed/.
"""

from __future__ import annotations

import pytest
import torch

from megatron_snip.config import ModelConfig
from megatron_snip.model import shapes
from megatron_snip.model.layers import (
    ColumnParallelLinear,
    PrecisionLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_tensor,
    unshard_tensors,
)
from megatron_snip.model.llama import LlamaModel, count_parameters, cross_entropy_loss
from megatron_snip.parallel.topology import TensorParallel

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2)
VOCAB = 320


def build(seed=3, **kw):
    torch.manual_seed(seed)
    return LlamaModel(CFG, VOCAB, **kw)


def tp_view(rank, size=2):
    return TensorParallel(group=None, size=size, rank=rank)


def test_same_seed_same_model_and_stages_hold_slices_of_it():
    full = build()
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), build().state_dict().values()))
    first, last = build(layers=[0], post_process=False), build(layers=[1], pre_process=False)
    ref = full.state_dict()
    for stage in (first, last):
        for name, t in stage.state_dict().items():
            assert torch.equal(t, ref[name]), name  # global names, identical values
    assert set(first.state_dict()) | set(last.state_dict()) == set(ref)
    assert "lm_head.weight" not in first.state_dict() and "embedding.weight" not in last.state_dict()
    assert [g.layer for g in last.gemm_ids()] == [1] * 12


def test_tp_shards_unshard_to_the_tp1_model():
    size = 2
    full = build()
    shards = [build(tp=tp_view(r, size)) for r in range(size)]
    merged = full.unsharded_state_dict([m.state_dict() for m in shards])
    ref = full.state_dict()
    assert merged.keys() == ref.keys()
    for name in ref:
        assert torch.equal(merged[name], ref[name]), name
    for r, m in enumerate(shards):  # and the other direction
        for name, t in m.sharded_state_dict(ref).items():
            assert torch.equal(t, m.state_dict()[name]), name
    spec = full.tp_shard_spec()
    assert spec["layers.0.mlp.fc1.weight"] == (0, 2) and spec["layers.0.attn.proj.weight"] == (1, 1)
    assert spec["layers.0.attn_norm.weight"] is None and spec["embedding.weight"] == (0, 1)


def test_qkv_shards_whole_kv_groups():
    """Rank r's qkv output is kv group r's [q.., k, v] block of the fused output, so the local
    attention sees H/tp query heads with their own kv head."""
    full, half = build(), build(tp=tp_view(1))
    x = torch.randn(2, 8, CFG.hidden_size)
    y_full = full.layers["0"].attn.qkv(x)  # (B, S, G*(H/G+2)*Hd), group-major
    y_local = half.layers["0"].attn.qkv(x)
    hd, qpg = CFG.head_dim, CFG.num_attention_heads // CFG.num_kv_heads
    group1 = y_full.view(2, 8, CFG.num_kv_heads, qpg + 2, hd)[:, :, 1].reshape(2, 8, -1)
    torch.testing.assert_close(y_local, group1, rtol=1e-6, atol=1e-6)
    assert half.layers["0"].attn.num_heads == 2 and half.layers["0"].attn.num_groups == 1


def test_fc1_local_output_is_gate_r_then_up_r():
    full, shards = build(), [build(tp=tp_view(r)) for r in range(2)]
    x = torch.randn(3, 5, CFG.hidden_size)
    gate, up = full.layers["1"].mlp.fc1(x).chunk(2, dim=-1)
    f_local = CFG.ffn_hidden_size // 2
    for r, m in enumerate(shards):
        g_r, u_r = m.layers["1"].mlp.fc1(x).chunk(2, dim=-1)
        sl = slice(r * f_local, (r + 1) * f_local)
        torch.testing.assert_close(g_r, gate[..., sl], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(u_r, up[..., sl], rtol=1e-6, atol=1e-6)


def test_row_parallel_partials_sum_to_the_full_output():
    full, shards = build(), [build(tp=tp_view(r)) for r in range(2)]
    x = torch.randn(2, 4, CFG.ffn_hidden_size)
    ref = full.layers["0"].mlp.fc2(x)
    parts = [m.layers["0"].mlp.fc2.local_gemm(x.chunk(2, dim=-1)[r]) for r, m in enumerate(shards)]
    torch.testing.assert_close(parts[0] + parts[1], ref, rtol=1e-5, atol=1e-6)


def test_shard_unshard_round_trip_with_partitions():
    t = torch.arange(48.0).reshape(12, 4)
    shards = [shard_tensor(t, 0, 3, r, partitions=2) for r in range(3)]
    assert shards[1][:, 0].tolist() == [8, 12, 32, 36]  # rows 2, 3 of the first half and 8, 9 of the second
    assert torch.equal(unshard_tensors(shards, 0, partitions=2), t)
    with pytest.raises(ValueError, match="3 tensor-parallel shards"):
        shard_tensor(torch.zeros(10, 4), 0, 3, 0)


def test_bad_tp_splits_are_value_errors():
    with pytest.raises(ValueError, match=r"out_features=30 .*tp=4"):
        ColumnParallelLinear(8, 30, layer=0, linear="qkv", init_std=0.02, tp=tp_view(0, 4))
    with pytest.raises(ValueError, match=r"in_features=6 .*tp=4"):
        RowParallelLinear(6, 8, layer=0, linear="fc2", init_std=0.02, tp=tp_view(0, 4))
    with pytest.raises(ValueError, match=r"vocabulary size 321 .*parallel.tp=2"):
        VocabParallelEmbedding(321, 8, init_std=0.02, tp=tp_view(0))
    with pytest.raises(ValueError, match=r"model.num_kv_heads=2 .*parallel.tp=4"):
        LlamaModel(CFG, VOCAB, tp=tp_view(0, 4))


def test_unsharded_api_is_unchanged():
    torch.manual_seed(0)
    lin = PrecisionLinear(16, 32, layer=3, linear="fc2", init_std=0.02)
    assert lin.weight.shape == (32, 16) and lin.amax_reduce is None and lin.probe is None
    x = torch.randn(4, 16)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    m = build()
    tokens = torch.randint(0, VOCAB, (2, 9))
    logits = m(tokens[:, :-1])
    assert logits.shape == (2, 8, VOCAB) and logits.dtype == torch.float32
    assert torch.equal(m.loss(logits, tokens[:, 1:]), cross_entropy_loss(logits, tokens[:, 1:]))
    assert len(list(m.precision_linears())) == 8 and len(m.gemm_ids()) == 24


def test_builds_on_meta_device():
    with torch.device("meta"):
        m = LlamaModel(CFG, VOCAB, tp=tp_view(1))
    assert m.layers["0"].mlp.fc1.weight.is_meta and m.layers["0"].mlp.fc1.weight.shape == (CFG.ffn_hidden_size, 64)
    assert m.embedding.weight.shape == (VOCAB // 2, 64)


def test_plan_shape_check_uses_local_tp_shapes():
    from megatron_snip.model.shapes import linear_numel, model_linear_shapes
    from megatron_snip.precision.plan import PrecisionPlan

    plan = PrecisionPlan.uniform("mxfp4", CFG.num_layers, linear_numel(model_linear_shapes(CFG)))
    assert build().plan_shape_errors(plan, tokens=64) == []
    errors = build(tp=tp_view(0)).plan_shape_errors(plan, tokens=64)  # fc2's local K = 96/2 = 48, not a multiple of 32
    assert [e.split("=")[0] for e in errors] == ["0.fc2.fprop", "1.fc2.fprop"], errors
    assert "48" in errors[0] and "tp=2" in errors[0]
    assert build().plan_shape_errors(PrecisionPlan.uniform("nvfp4", 2, linear_numel(model_linear_shapes(CFG))),
                                     tokens=40)  # wgrad's 16-point Hadamard along T=40


def test_grad_reducer_single_process_matches_torch_clipping():
    from megatron_snip.parallel.ddp import GradReducer
    from megatron_snip.parallel.topology import ParallelTopology

    a, b = build(), build()
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    for m in (a, b):
        m.loss(m(tokens[:, :-1]), tokens[:, 1:]).backward()
    red = GradReducer(a.parameters(), ParallelTopology.single())
    red.reduce()  # no group: nothing to reduce, grads untouched
    ref_norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    norm = red.clip_(0.5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert red.global_numel() == sum(p.numel() for p in a.parameters())


def test_linear_shapes_and_flop_accounting():
    sh = shapes.linear_shapes(8192, 28672, 64, 8, 128)
    assert sh == {"qkv": (10240, 8192), "proj": (8192, 8192), "fc1": (57344, 8192), "fc2": (8192, 28672)}
    numel = shapes.linear_numel(sh)
    assert shapes.gemm_flops(sh, 10)["fc2"] == 2 * 10 * 8192 * 28672
    per_step = shapes.linear_flops_per_step(sh, 4096, 80)
    assert per_step == 80 * 3 * 2 * 4096 * sum(numel.values())
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=64"):
        shapes.linear_shapes(8192, 28672, 64, 3)
    with pytest.raises(ValueError, match="tokens=0"):
        shapes.gemm_flops(sh, 0)


def test_model_shapes_describe_the_built_model():
    # model/shapes.py is what sizing and SNIP read; the model built from it must agree, TP shards included.
    full_shapes = shapes.model_linear_shapes(CFG)
    for tp, model in ((1, build()), (2, build(tp=tp_view(1)))):
        local = shapes.local_linear_shapes(full_shapes, tp)
        for lin in model.precision_linears():
            assert (lin.out_features, lin.in_features) == local[lin.linear], (tp, lin.layer, lin.linear)
            assert lin.global_shape == full_shapes[lin.linear]
    counts = shapes.parameter_counts(CFG, VOCAB)
    assert counts.total == count_parameters(build())
    assert counts.blocks == sum(p.numel() for n, p in build().named_parameters() if n.startswith("layers."))
