"""The production recipes as static policies (issue #33): ``tail``, ``attn_protected``, ``mlp_only``.

Each rule is checked against what its source says it protects, with and without ``fair_share``,
on a TinyLlama-shaped block (attention's qkv + proj are 1/4 of a block's linear FLOPs at d=2048,
ffn 5632, 4 KV heads, so rho = 0.8 forces the MLP-only recipe to top up)."""

from __future__ import annotations

import pytest

from megatron_snip.model import shapes as model_shapes
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.plan import all_gemm_ids
from megatron_snip.snip.policies import PlanContext, make_plan, parse_policy

NUM_LAYERS = 8
NUMEL = model_shapes.linear_numel(model_shapes.linear_shapes(2048, 5632, 32, 4))


def ctx(rho, granularity="gemm", fair_share=False):
    return PlanContext(num_layers=NUM_LAYERS, linear_numel=NUMEL, formats=("fp8_block", "fp4_block"),
                       fp4_target=rho, granularity=granularity, fair_share=fair_share)


def high(plan):
    return {g for g, f in plan.entries if f not in FP4_FORMATS}


def unit_weight(granularity):
    return max(NUMEL.values()) * (3 if granularity == "layer" else 1)


def test_tail_counts_parse_and_explicit_counts_are_honoured():
    assert parse_policy("tail:3").ends == (0, 3)
    with pytest.raises(ValueError, match="tail:<last>"):
        parse_policy("tail:x")
    plan = make_plan("tail:3", ctx(0.9))
    assert {g.layer for g in high(plan)} == {5, 6, 7}
    assert all(f == "fp8_block" for g, f in plan.entries if g.layer >= 5)
    with pytest.raises(ValueError, match="num_layers=8"):
        make_plan("tail:9", ctx(0.5))


def test_tail_without_count_protects_the_most_last_blocks_that_meet_rho():
    plan = make_plan("tail", ctx(0.75))  # 8 blocks: 2 protected blocks = exactly 75% FP4
    assert {g.layer for g in high(plan)} == {6, 7}
    assert dict(plan.extra)["tail_blocks"] == 2
    assert plan.fp4_flops_share >= 0.75


@pytest.mark.parametrize("granularity", ["gemm", "layer"])
def test_tail_fair_share_protects_from_the_last_block_backwards(granularity):
    plan = make_plan("tail", ctx(0.8, granularity, fair_share=True))
    assert 0.8 <= plan.fp4_flops_share
    protected = high(plan)
    assert {g for g in all_gemm_ids(NUM_LAYERS) if g.layer == 7} <= protected  # the last block whole
    # units that no longer fit are skipped and smaller ones further up may still fit: protection
    # still falls with the distance from the end
    weight = [sum(NUMEL[g.linear] for g in protected if g.layer == layer) for layer in range(NUM_LAYERS)]
    assert weight == sorted(weight) and weight[4] == 0
    total = sum(NUMEL[g.linear] for g in all_gemm_ids(NUM_LAYERS))
    assert (plan.fp4_flops_share - 0.8) * total < unit_weight(granularity)  # within one unit of rho


def test_attn_protected_is_the_attention_layer_type_rule():
    for fair in (False, True):
        a = make_plan("attn_protected", ctx(0.7, fair_share=fair))
        b = make_plan("layer_type:qkv,proj", ctx(0.7, fair_share=fair))
        assert a.as_dict() == b.as_dict()
    plan = make_plan("attn_protected", ctx(0.7))  # attention is 25% of the FLOPs: all of it fits
    assert {g.linear for g in high(plan)} == {"qkv", "proj"}
    assert len(high(plan)) == NUM_LAYERS * 2 * 3


def test_mlp_only_keeps_attention_out_of_fp4_when_the_mlp_alone_meets_rho():
    plan = make_plan("mlp_only", ctx(0.7))
    assert {g.linear for g in high(plan)} == {"qkv", "proj"}
    assert all(f in FP4_FORMATS for g, f in plan.entries if g.linear in ("fc1", "fc2"))


def test_mlp_only_tops_up_with_forward_gemms_from_the_middle_blocks():
    plan = make_plan("mlp_only", ctx(0.8))
    assert plan.fp4_flops_share >= 0.8
    topped = {g for g, f in plan.entries if g.linear in ("qkv", "proj") and f in FP4_FORMATS}
    assert topped and {g.gemm for g in topped} == {"fprop"}  # 5% of FLOPs: forward GEMMs only
    assert {g.layer for g in topped} <= {2, 3, 4, 5}  # from the middle outward, the ends stay protected
    assert all(f in FP4_FORMATS for g, f in plan.entries if g.linear in ("fc1", "fc2"))


def test_mlp_only_fair_share_protects_backward_attention_gemms_first():
    plan = make_plan("mlp_only", ctx(0.8, fair_share=True))
    assert plan.fp4_flops_share >= 0.8
    protected = high(plan)
    assert {g.linear for g in protected} <= {"qkv", "proj"}
    attention_wgrad = {g for g in all_gemm_ids(NUM_LAYERS) if g.linear in ("qkv", "proj") and g.gemm == "wgrad"}
    assert attention_wgrad <= protected
    assert any(g.gemm == "fprop" for g in set(all_gemm_ids(NUM_LAYERS)) - protected if g.linear in ("qkv", "proj"))
