"""experiments/comparison/ protocol options of issue #33: evaluation windows spread over each domain,
the modeled GEMM time of every final plan, and the WSD continuation."""

from __future__ import annotations

import pytest

from experiments.comparison import protocol
from experiments.comparison import report as report_writer
from experiments.tests.test_compare_policies import MX, SMALL_SETS, small_protocol
from megatron_snip.config import load_config


def test_eval_windows_reach_every_run_and_the_report(tmp_path):
    # #33 item 7: a domain measured on windows spread over its whole text, not its first pages.
    for windows in ("first", "spread"):
        p = small_protocol(eval_windows=windows, eval_batches=4)
        for spec in protocol.primary_runs(p):
            cfg = load_config(protocol.config_path(p), protocol.run_overrides(spec, p, tmp_path / spec.name))
            assert (cfg.training.eval_windows, cfg.training.eval_batches) == (windows, 4)
        text = "\n".join(report_writer.protocol_section([], p, []))
        assert ("spread evenly over the whole text" in text) == (windows == "spread")
        assert ("the first windows of each" in text) == (windows == "first")
    with pytest.raises(ValueError, match="--eval-windows"):
        small_protocol(eval_windows="middle")
    with pytest.raises(ValueError, match="set by the driver"):
        small_protocol(overrides=(*SMALL_SETS, 'training.eval_windows="spread"'))


def test_modeled_gemm_time_of_fp4_share_runs_at_blackwell_ratios(tmp_path):
    # #33: equal FP4 share is not equal GEMM time when a plan protects in BF16; the report prices each
    # final plan at Blackwell's ratios (bf16 1, FP8 0.5, FP4 0.25; fp4_block as a native FP4).
    from megatron_snip.model.shapes import linear_numel, model_linear_shapes
    from megatron_snip.precision.plan import PrecisionPlan

    p = small_protocol(format_sets=(("bf16", "fp8_block", "fp4_block"),), policies=("snip", "tail"))
    cfg = load_config(protocol.config_path(p), list(p.overrides))
    numel = linear_numel(model_linear_shapes(cfg.model))
    fp4 = PrecisionPlan.uniform("fp4_block", cfg.model.num_layers, numel)
    entries = fp4.as_dict()
    fc1 = [g for g in entries if g.linear == "fc1"]
    mixed = {**entries, **{g: "bf16" for g in fc1}}  # fc1's three GEMMs in BF16, the rest FP4
    share = numel["fc1"] / sum(numel.values())
    records = []
    for name, plan in (("tail", fp4), ("snip", PrecisionPlan.create(mixed, numel))):
        d = tmp_path / name / "plans"
        d.mkdir(parents=True)
        (d / "step_000004.json").write_text(plan.to_json())
        records.append({"policy": name, "formats": ["bf16", "fp8_block", "fp4_block"], "rho": 0.75,
                        "run_dir": str(tmp_path / name), "final_plan": "plans/step_000004.json"})
    text = "\n".join(report_writer.plan_time_section(records, p))
    assert "fp4_block 0.25" in text and "bf16 1" in text and "fp8_block 0.5" in text
    assert "| tail | bf16,fp8_block,fp4_block | 0.75 | 1 | 0.2500 - 0.2500 |" in text
    expected = share * 1.0 + (1 - share) * 0.25
    assert f"| snip | bf16,fp8_block,fp4_block | 0.75 | 1 | {expected:.4f} - {expected:.4f} |" in text
    assert report_writer.plan_time_section([{**records[0], "run_dir": str(tmp_path / "gone")}], p) == []


def test_wsd_continuation_holds_the_peak_then_decays(tmp_path):
    # #33 item 4: a continuation with a stable and a decay phase; the config's schedule stays the reference.
    from megatron_snip.training.lr import lr_at

    ref = small_protocol(base_steps=3, steps=10, warmup=1)
    wsd = small_protocol(base_steps=3, steps=10, warmup=1, continuation_schedule="wsd")
    snip = protocol.RunSpec(1, "snip", MX, 0.75)
    for p, schedule in ((ref, "cosine"), (wsd, "wsd")):
        cfg = load_config(protocol.config_path(p), protocol.run_overrides(snip, p, tmp_path / "r"))
        assert cfg.training.lr_schedule == schedule
        base = load_config(protocol.config_path(p), protocol.run_overrides(protocol.base_run(1), p, tmp_path / "b"))
        assert base.training.lr_schedule == "constant"
    assert protocol.resolved_config(snip, ref) == protocol.resolved_config(snip, small_protocol(base_steps=3, steps=10,
                                                                                             warmup=1))
    cfg = load_config(protocol.config_path(wsd), protocol.run_overrides(snip, wsd, tmp_path / "r")).training
    lrs = [lr_at(s, cfg) for s in range(10)]  # 0-based steps; the decay's 2 steps start from the peak
    assert lrs[:9] == [cfg.lr] * 9 and cfg.min_lr < lrs[9] < cfg.lr
    text = "\n".join(report_writer.protocol_section([], wsd, []))
    assert "held at" in text and "over the last 2" in text
    with pytest.raises(ValueError, match="--continuation-schedule"):
        small_protocol(continuation_schedule="wsd")  # from scratch: not a continuation
    with pytest.raises(ValueError, match="--continuation-schedule"):
        small_protocol(base_steps=3, continuation_schedule="linear")


def test_continuation_order_reorders_the_continued_runs_data_only(tmp_path):
    # Replicas of a comparison on the same bases: another order of the training windows per continued
    # run (data.shuffle_seed), the base and its held-out text (training.seed) untouched.
    ref = small_protocol(base_steps=3, steps=10, warmup=1)
    rep = small_protocol(base_steps=3, steps=10, warmup=1, continuation_order=2)
    for seed in (1, 7):
        snip = protocol.RunSpec(seed, "snip", MX, 0.75)
        for p, order in ((ref, -1), (rep, protocol.CONTINUATION_ORDER_STRIDE * 2 + seed)):
            cfg = load_config(protocol.config_path(p), protocol.run_overrides(snip, p, tmp_path / "r"))
            assert (cfg.data.shuffle_seed, cfg.training.seed) == (order, seed)
            base = load_config(protocol.config_path(p), protocol.run_overrides(protocol.base_run(seed), p, tmp_path / "b"))
            assert base.data.shuffle_seed == -1
    # a record made before the option (no data.shuffle_seed field) is the order-0 run
    snip = protocol.RunSpec(1, "snip", MX, 0.75)
    recorded = protocol.resolved_config(snip, ref)
    del recorded["data"]["shuffle_seed"]
    assert protocol.same_config(recorded, protocol.resolved_config(snip, ref))
    assert not protocol.same_config(protocol.resolved_config(snip, ref), protocol.resolved_config(snip, rep))
    assert "Continuation order 2" in "\n".join(report_writer.protocol_section([], rep, []))
    with pytest.raises(ValueError, match="--continuation-order"):
        small_protocol(continuation_order=1)  # from scratch: nothing is continued
    with pytest.raises(ValueError, match="--continuation-order"):
        small_protocol(base_steps=3, continuation_order=-1)
    with pytest.raises(ValueError, match="below 1000"):
        small_protocol(base_steps=3, continuation_order=1, seeds=(1, 1000))
    with pytest.raises(ValueError, match="set by the driver"):
        small_protocol(overrides=(*SMALL_SETS, "data.shuffle_seed=3"))
