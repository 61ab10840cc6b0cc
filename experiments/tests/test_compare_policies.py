"""experiments/compare_policies.py and experiments/comparison/: run list, resume, statistics and report, one real
tiny end-to-end run."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import statistics
from pathlib import Path

import pytest

from experiments import compare_policies as cli
from experiments.comparison import aggregate, protocol, runner, store
from experiments.comparison import report as report_writer
from experiments.comparison.estimate import CostModel
from experiments.comparison.protocol import REPO
from megatron_snip.config import load_config

MX = ("fp8", "mxfp4")
NV = ("fp8", "nvfp4")
# A 2-layer d=64 model: every format's block divides its dims and the 2x32-token micro-batch.
SMALL_SETS = ("model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "training.seq_len=32",
              "training.micro_batch_size=2", "training.global_batch_size=2", "training.warmup_steps=1",
              "precision.compile_quantizers=false")  # eager: compiling for these shapes would dominate


def small_protocol(**kw) -> protocol.Protocol:
    base = {"steps": 4, "warmup": 1, "interval": 2, "seeds": (1, 2, 3), "valid_corpora": ("bundled:moby_dick",),
                "eval_interval": 2, "eval_batches": 1, "overrides": SMALL_SETS}
    return protocol.Protocol(**{**base, **kw})


# --- run list -----------------------------------------------------------------------------
def test_primary_runs_dedup_format_free_policies():
    p = small_protocol()
    runs = protocol.primary_runs(p)
    assert len(runs) == 3 * (4 + 5 * 2)  # per seed: 4 format-free policies + 5 policies x 2 format sets
    assert len({r.name for r in runs}) == len(runs) and len({r.key for r in runs}) == len(runs)
    for pol in protocol.FORMAT_FREE_POLICIES:
        mine = [r for r in runs if r.policy == pol]
        assert sorted(r.seed for r in mine) == [1, 2, 3]  # once per seed, not once per format set
        assert all(r.formats is None and r.rho is None for r in mine)
    assert not [r for r in runs if r.policy in protocol.ORACLE_POLICIES]  # only when --policies names them
    assert not [r for r in runs if r.policy in protocol.PRODUCTION_RULES + protocol.ABLATIONS]  # likewise
    for pol in protocol.FORMAT_POLICIES:
        if pol in protocol.ORACLE_POLICIES + protocol.PRODUCTION_RULES + protocol.ABLATIONS:
            continue
        mine = [r for r in runs if r.policy == pol]
        assert sorted((r.formats, r.seed) for r in mine) == sorted((fs, s) for fs in (NV, MX) for s in (1, 2, 3))
        assert all(r.rho == 0.75 for r in mine)
    # format set first (the first, most important, finishes first), seed-major inside: whole seeds finish first
    first = [r for r in runs if r.formats in (None, NV)]
    assert runs[:len(first)] == first and [r.seed for r in first] == sorted(r.seed for r in first)
    rest = runs[len(first):]
    assert {r.formats for r in rest} == {MX} and [r.seed for r in rest] == sorted(r.seed for r in rest)
    assert protocol.RunSpec(2, "snip", MX, 0.75).name == "snip_fp8-mxfp4_rho0.75_seed2"
    assert protocol.RunSpec(1, "uniform:nvfp4").name == "uniform-nvfp4_seed1"


def test_policy_subset_and_single_format_set():
    p = small_protocol(policies=("bf16", "snip"), format_sets=(MX,), seeds=(7,))
    assert [r.name for r in protocol.primary_runs(p)] == ["bf16_seed7", "snip_fp8-mxfp4_rho0.75_seed7"]


def test_any_uniform_format_runs_once_per_seed():
    # The paper's FP4 and recipe variants as uniform policies (issue #14's regime map); others are refused.
    p = small_protocol(policies=("bf16", "uniform:fp4_block", "uniform:fp4_block-sr"), seeds=(1, 2))
    assert [r.name for r in protocol.primary_runs(p)] == ["bf16_seed1", "uniform-fp4-block_seed1",
                                                         "uniform-fp4-block-sr_seed1", "bf16_seed2",
                                                         "uniform-fp4-block_seed2", "uniform-fp4-block-sr_seed2"]
    with pytest.raises(ValueError, match="not part of this comparison"):
        small_protocol(policies=("bf16_ends:1,1",))


def test_sweep_runs_skip_primary_rho_and_follow_best_baseline():
    p = small_protocol(sweep_rhos=(0.5, 0.75, 0.9), sweep_format_sets=(MX,))
    runs = protocol.sweep_runs(p, {MX: "layer_type"})
    assert len(runs) == 3 * 2 * 2  # seeds x {snip, layer_type} x {0.5, 0.9}; 0.75 is a primary run
    assert {(r.policy, r.rho) for r in runs} == {(pol, rho) for pol in ("snip", "layer_type") for rho in (0.5, 0.9)}
    assert all(r.group == "sweep" and r.formats == MX for r in runs)
    assert {r.policy for r in protocol.sweep_runs(p, {MX: None})} == {"snip"}  # baseline not known yet
    assert not {r.key for r in runs} & {r.key for r in protocol.primary_runs(p)}


def test_every_run_config_is_valid_and_pairs_by_seed(tmp_path):
    p = small_protocol(sweep_rhos=(0.5,), sweep_format_sets=(MX,))
    for spec in protocol.primary_runs(p) + protocol.sweep_runs(p, {MX: "random"}):
        cfg = load_config(protocol.config_path(p), protocol.run_overrides(spec, p, tmp_path / spec.name)).validate()
        assert cfg.training.seed == spec.seed == cfg.snip.seed
        assert cfg.precision.initial_plan == "bf16" and cfg.snip.enabled and cfg.snip.policy == spec.policy
        assert (cfg.snip.warmup, cfg.snip.interval, cfg.training.max_steps) == (1, 2, 4)
        assert cfg.model.num_layers == 2  # the protocol's --set reached the run
        if spec.formats is not None:
            assert cfg.snip.formats == spec.formats and cfg.snip.fp4_target == spec.rho
        elif spec.policy == "uniform:mxfp4":
            assert "mxfp4" in cfg.snip.formats


def test_per_set_rhos_and_continued_run_list():
    FB = ("fp8_block", "fp4_block")
    p = small_protocol(seeds=(1, 2), policies=("bf16", "uniform:fp4_block", "snip", "random"), format_sets=(FB, NV),
                       format_rhos=((0.75, 0.8), (0.75, 0.9)), base_steps=3)
    names = [r.name for r in protocol.primary_runs(p)]
    assert names[:8] == ["bf16_seed1", "uniform-fp4-block_seed1",
                         "random_fp8_block-fp4_block_rho0.75_seed1", "snip_fp8_block-fp4_block_rho0.75_seed1",
                         "random_fp8_block-fp4_block_rho0.8_seed1", "snip_fp8_block-fp4_block_rho0.8_seed1",
                         "bf16_seed2", "uniform-fp4-block_seed2"]
    assert {(r.formats, r.rho) for r in protocol.primary_runs(p) if r.formats} == {
        (FB, 0.75), (FB, 0.8), (NV, 0.75), (NV, 0.9)}
    assert p.rhos_of(NV) == (0.75, 0.9) and small_protocol().rhos_of(MX) == (0.75,)
    assert protocol.base_run(2).name == "base_seed2" and protocol.base_run(2).group == "base"


def test_continued_runs_start_from_their_seeds_base(tmp_path):
    p = small_protocol(seeds=(1, 2), policies=("bf16", "snip"), format_sets=(MX,), base_steps=5)
    base = load_config(protocol.config_path(p), protocol.run_overrides(protocol.base_run(2), p, tmp_path / "base_seed2"))
    base.validate()
    assert (base.training.max_steps, base.training.lr_schedule, base.snip.enabled) == (5, "constant", False)
    assert not base.training.init_from and base.training.seed == 2
    for spec in protocol.primary_runs(p):
        cfg = load_config(protocol.config_path(p), protocol.run_overrides(spec, p, tmp_path / spec.name)).validate()
        assert cfg.training.init_from == str(tmp_path / f"base_seed{spec.seed}") and cfg.training.init_optimizer
        assert cfg.training.warmup_steps == 0 and cfg.training.max_steps == 4  # decay from the peak, no new warmup
        assert cfg.training.lr_schedule == "cosine"
    scratch = small_protocol(seeds=(1,), policies=("bf16",), format_sets=(MX,))
    cfg = load_config(protocol.config_path(scratch), protocol.run_overrides(protocol.primary_runs(scratch)[0], scratch,
                                                                           tmp_path / "x"))
    assert not cfg.training.init_from and cfg.training.warmup_steps == 1  # from scratch: the protocol's own warmup


def test_continued_protocol_rejects_bad_input():
    with pytest.raises(ValueError, match="--base-steps"):
        small_protocol(base_steps=-1)
    with pytest.raises(ValueError, match="training.lr_schedule"):
        small_protocol(base_steps=5, overrides=SMALL_SETS + ('training.lr_schedule="wsd"',))
    small_protocol(overrides=SMALL_SETS + ('training.lr_schedule="wsd"',))  # from scratch it is the user's choice
    with pytest.raises(ValueError, match="training.init_from"):
        small_protocol(overrides=('training.init_from="x"',))
    with pytest.raises(ValueError, match="rho lists"):
        small_protocol(format_sets=(MX, NV), format_rhos=((0.75,),))
    with pytest.raises(ValueError, match="first format set's rhos"):
        small_protocol(format_sets=(MX,), format_rhos=((0.5, 0.9),))
    with pytest.raises(ValueError, match="--format-sets"):
        small_protocol(format_sets=(MX,), format_rhos=((0.75, 1.5),))


def test_format_sets_with_rhos_on_the_command_line():
    args = cli.build_parser().parse_args(["--format-sets", "fp8_block,fp4_block@0.75,0.8;fp8,nvfp4", "--rho", "0.75",
                                          "--base-steps", "10"])
    p = cli.protocol_from_args(args)
    assert p.format_sets == (("fp8_block", "fp4_block"), NV) and p.format_rhos == ((0.75, 0.8), (0.75,))
    assert p.base_steps == 10 and p.continued
    assert cli.protocol_from_args(cli.build_parser().parse_args([])).format_rhos == ()  # the recorded default
    assert protocol.Protocol.from_json_dict(json.loads(json.dumps(p.to_json_dict()))) == p


def test_gemm_time_target_runs_model_the_gpu(tmp_path):
    """--target gemm_time --gpu h100: the numbers after '@' are GEMM-time budgets, a set needs no FP4
    format, and every run gets the budget and H100's time costs (snip.time_costs)."""
    args = cli.build_parser().parse_args(["--target", "gemm_time", "--gpu", "h100", "--format-sets", "bf16,fp8@0.6",
                                          "--rho", "0.6", "--policies", "bf16;uniform:fp8;random;snip",
                                          "--set", "model.num_layers=2", "--steps", "4", "--warmup", "1",
                                          "--interval", "2"])
    p = cli.protocol_from_args(args)
    assert p.target == "gemm_time" and p.time_costs == ("bf16=1", "fp8=0.5")
    assert protocol.Protocol.from_json_dict(json.loads(json.dumps(p.to_json_dict()))) == p
    runs = protocol.primary_runs(p)
    assert [r.name for r in runs[:4]] == ["bf16_seed1", "uniform-fp8_seed1", "random_bf16-fp8_time0.6_seed1",
                                          "snip_bf16-fp8_time0.6_seed1"]
    for spec in runs:
        cfg = load_config(protocol.config_path(p), protocol.run_overrides(spec, p, tmp_path / spec.name))
        cfg.validate()
        assert cfg.snip.target == "gemm_time" and cfg.snip.time_budget == 0.6 and cfg.snip.fp4_target == 0.0
        assert cfg.snip.time_costs == ("bf16=1", "fp8=0.5") and cfg.snip.formats == ("bf16", "fp8")
    with pytest.raises(ValueError, match="--gpu"):
        protocol.Protocol(target="gemm_time", format_sets=(("bf16", "fp8"),))


def test_gemm_time_target_with_given_time_costs():
    """--time-costs prices the formats directly (the comparison's fp4_block as native FP4, which --gpu
    b200 would price as emulated); every format of the sets must be priced, and not with --gpu too."""
    base = ["--target", "gemm_time", "--format-sets", "bf16,fp8_block,fp4_block@0.2743", "--rho", "0.2743"]
    args = cli.build_parser().parse_args(base + ["--time-costs", "bf16=1, fp8_block=0.5,fp4_block=0.25"])
    assert cli.protocol_from_args(args).time_costs == ("bf16=1", "fp8_block=0.5", "fp4_block=0.25")
    args = cli.build_parser().parse_args(base + ["--time-costs", "bf16=1,fp8_block=0.5"])
    with pytest.raises(ValueError, match=r"prices no \['fp4_block'\]"):
        cli.protocol_from_args(args)
    args = cli.build_parser().parse_args(base + ["--time-costs", "bf16=1,fp8_block=0.5,fp4_block=0.25", "--gpu", "b200"])
    with pytest.raises(ValueError, match="not both"):
        cli.protocol_from_args(args)
    with pytest.raises(SystemExit):  # argparse: 'fp4_block=x' is no ratio
        cli.build_parser().parse_args(base + ["--time-costs", "bf16=1,fp4_block=x"])


def test_base_runs_come_first_and_again_when_their_checkpoint_is_gone(tmp_path, monkeypatch):
    p = small_protocol(seeds=(1, 2), policies=("bf16", "snip"), format_sets=(MX,), base_steps=3)
    specs = protocol.primary_runs(p)
    calls, attempts = [], []

    def fake_execute(spec, p_, out_dir, **kw):
        calls.append(spec.name)
        attempts.append(spec.name)
        if spec.policy == protocol.BASE_POLICY:
            (out_dir / spec.name / "checkpoints").mkdir(parents=True, exist_ok=True)
        status = "failed" if attempts.count("base_seed2") == 1 and spec.name == "base_seed2" else "ok"
        return {"name": spec.name, "policy": spec.policy, "status": status, "seed": spec.seed,
                "config": protocol.resolved_config(spec, p_), "wall_s": 1.0}

    monkeypatch.setattr(runner, "execute", fake_execute)
    runner.run_all(specs, p, tmp_path, jobs=1, threads=1, timeout_s=10, log=lambda *_: None)
    # both bases before any continuation; seed 2's base failed, so its continuations did not run
    assert calls == ["base_seed1", "base_seed2", "bf16_seed1", "snip_fp8-mxfp4_rho0.75_seed1"]
    calls.clear()
    import shutil
    shutil.rmtree(tmp_path / "base_seed1")  # another machine: the records came along, the run directories did not
    runner.run_all(specs, p, tmp_path, jobs=1, threads=1, timeout_s=10, log=lambda *_: None)
    assert calls == ["base_seed2", "bf16_seed2", "snip_fp8-mxfp4_rho0.75_seed2"]  # seed 1 is done: no base needed
    calls.clear()
    more = small_protocol(seeds=(1, 2), policies=("bf16", "snip", "random"), format_sets=(MX,), base_steps=3)
    runner.run_all(protocol.primary_runs(more), more, tmp_path, jobs=1, threads=1, timeout_s=10, log=lambda *_: None)
    assert calls == ["base_seed1", "random_fp8-mxfp4_rho0.75_seed1", "random_fp8-mxfp4_rho0.75_seed2"]
    current = store.current_results(more, store.read_results(tmp_path / "results.jsonl"))
    assert len(current) == 6 and not any(r["policy"] == protocol.BASE_POLICY for r in current)  # bases: no results


def test_a_base_trained_again_to_other_losses_is_named(tmp_path, monkeypatch):
    """Another machine's float arithmetic can train a long base run to another base: the continuations
    recorded from the first do not pair with new ones, and the driver says so (and only then)."""
    p = small_protocol(seeds=(1,), policies=("bf16",), format_sets=(MX,), base_steps=3)
    more = small_protocol(seeds=(1,), policies=("bf16", "snip"), format_sets=(MX,), base_steps=3)
    final = {"val_loss": 1.5}

    def fake_execute(spec, p_, out_dir, **kw):
        if spec.policy == protocol.BASE_POLICY:
            (out_dir / spec.name / "checkpoints").mkdir(parents=True, exist_ok=True)
        return {"name": spec.name, "policy": spec.policy, "status": "ok", "seed": spec.seed, "final": dict(final),
                "config": protocol.resolved_config(spec, p_), "wall_s": 1.0, "machine": {"cpu_capability": "AVX512"}}

    monkeypatch.setattr(runner, "execute", fake_execute)
    runner.run_all(protocol.primary_runs(p), p, tmp_path, jobs=1, threads=1, timeout_s=10, log=lambda *_: None)
    import shutil
    for trained_again_to, warned in ((1.5, False), (1.5 + 2.0 ** -40, True)):
        shutil.rmtree(tmp_path / "base_seed1")  # another machine: the records came along, the run directory did not
        kept = [r for r in store.read_results(tmp_path / "results.jsonl") if r["policy"] != "snip"]
        (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))  # snip runs again
        final["val_loss"] = trained_again_to
        logged: list[str] = []
        runner.run_all(protocol.primary_runs(more), more, tmp_path, jobs=1, threads=1, timeout_s=10, log=logged.append)
        warnings = [m for m in logged if m.startswith("warning: base_seed1")]
        assert len(warnings) == int(warned), logged
    assert "1.5" in warnings[0] and "AVX512" in warnings[0] and "--out-dir" in warnings[0]


def test_the_record_names_the_machine():
    facts = runner.machine()
    import torch
    assert facts["torch"] == torch.__version__ and facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_verdict_and_snip_against_every_policy(tmp_path):
    assert report_writer.verdict(-0.03, 0.01) == "wins" and report_writer.verdict(0.03, 0.01) == "loses"
    assert report_writer.verdict(-0.015, 0.01) == "ties" and report_writer.verdict(-0.1, float("nan")) == "—"
    results = fake_results(tmp_path)
    p = small_protocol(seeds=(1, 2, 3), format_sets=(MX,), sweep_rhos=(0.5, 0.75), sweep_format_sets=(MX,))
    text = "\n".join(report_writer.snip_versus_section(results, p))
    d = [SNIP[s] - BF16[s] for s in (1, 2, 3)]
    se = statistics.stdev(d) / 3 ** 0.5
    expect = report_writer.verdict(statistics.mean(d), se)
    cell75 = text.split("rho = 0.75")[1]
    assert f"| bf16 | 0.000 | {statistics.mean(d):+.4f} ± {statistics.stdev(d) / 3 ** 0.5:.4f} (3) {expect} |" in cell75
    d_lt = [SNIP[s] - LAYER[s] for s in (1, 2)]
    assert f"{statistics.mean(d_lt):+.4f} ± {statistics.stdev(d_lt) / 2 ** 0.5:.4f} (2)" in cell75
    assert "### `fp8,mxfp4`, rho = 0.5" in text  # the sweep's cells too
    assert expect == "loses" and "loses to `bf16`." in cell75


def test_report_includes_an_earlier_report(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "old.md").write_text("# Results: from scratch\n\n## Protocol\n\n![c](figures/old_curves.png)\n")
    p = small_protocol(seeds=(1, 2, 3), format_sets=(MX,))
    text = report_writer.write_report(fake_results(tmp_path), p, docs / "results.md", command="x",
                                      appendix=docs / "old.md").read_text()
    tail = text.split("## Earlier: Results: from scratch")[1]
    assert "### Protocol" in tail and "![c](figures/old_curves.png)" in tail
    assert text.index("## What this shows") < text.index("## Earlier")



def test_protocol_rejects_bad_input():
    with pytest.raises(ValueError, match="training.seed"):
        small_protocol(overrides=("training.seed=3",))
    with pytest.raises(ValueError, match="fp8,bf16"):
        small_protocol(format_sets=(("fp8", "bf16"),))
    with pytest.raises(ValueError, match="--warmup"):
        small_protocol(warmup=4)
    with pytest.raises(ValueError, match="--seeds"):
        small_protocol(seeds=(1, 1))
    with pytest.raises(ValueError, match="--rho"):
        small_protocol(rho=1.5)


def test_best_static_baseline_uses_training_domain_only():
    def rec(policy, seed, val, other):
        return {"policy": policy, "formats": list(MX), "rho": 0.75, "seed": seed,
                "final": {"val_loss": val, "val_loss_moby_dick": other}}
    results = [rec("layer_type", 1, 2.00, 3.0), rec("layer_type", 2, 2.02, 3.0),
               rec("random", 1, 2.01, 1.0), rec("random", 2, 2.03, 1.0),  # best on the other domain
               rec("snip", 1, 1.0, 1.0), rec("min_rel_err", 1, 1.0, 1.0)]  # not static baselines
    assert store.best_static_baseline(results, MX, 0.75) == "layer_type"
    assert store.best_static_baseline(results, NV, 0.75) is None


def test_valid_corpora_defaults_replace_and_drop():
    assert cli.valid_corpora([]) == ("bundled:moby_dick", "corpus/python_docs.jsonl")  # shipped or fetched by name
    assert cli.valid_corpora([("python_docs", "/data/python_docs.jsonl")]) == ("bundled:moby_dick", "/data/python_docs.jsonl")
    assert cli.valid_corpora([("python_docs", ""), ("later", "x/later.jsonl")]) == ("bundled:moby_dick", "x/later.jsonl")
    assert cli.parse_valid_corpus("later=a/later.jsonl") == ("later", "a/later.jsonl")
    assert cli.parse_valid_corpus("python_docs=") == ("python_docs", "")
    with pytest.raises(argparse.ArgumentTypeError, match="val_loss_later"):  # the trainer names it by its stem
        cli.parse_valid_corpus("docs=a/later.jsonl")
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH"):
        cli.parse_valid_corpus("a/later.jsonl")


def test_missing_validation_corpus_stops_before_any_run(tmp_path, capsys):
    missing = tmp_path / "later.jsonl"
    argv = [*(a for s in SMALL_SETS for a in ("--set", s)), "--steps", "3", "--warmup", "1", "--seeds", "1",
            "--policies", "bf16", "--no-sweep", "--valid-corpus", f"later={missing}",
            "--out-dir", str(tmp_path / "cmp"), "--report", str(tmp_path / "results.md")]
    assert cli.main(argv + ["--dry-list"]) == 0  # listing still works, and says what is missing
    assert f"validation corpus {missing} does not exist" in capsys.readouterr().out
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "prepare_corpus.py" in err and "--valid-corpus NAME=" in err
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "results.md").exists()


# --- resume -------------------------------------------------------------------------------
def test_config_identity_follows_values_not_comments(tmp_path):
    """Editing a comment of the config file keeps recorded runs current; changing a value does not."""
    text = (REPO / "launch/configs/tiny.toml").read_text()
    assert "lr = 3e-3" in text
    variants = {"same": text, "comment": "# an edited comment\n" + text.replace("# tiny:", "# tiny (edited):"),
                "value": text.replace("lr = 3e-3", "lr = 2e-3")}
    configs = {}
    for name, body in variants.items():
        (tmp_path / f"{name}.toml").write_text(body)
        p = small_protocol(config=str(tmp_path / f"{name}.toml"))
        configs[name] = protocol.resolved_config(protocol.primary_runs(p)[0], p)
    assert protocol.same_config(configs["same"], configs["comment"])
    assert not protocol.same_config(configs["same"], configs["value"])


def test_config_identity_tolerates_new_fields_at_their_default():
    """A record made before a field existed stays current while the field is at its default
    (new fields keep the old behaviour); not once it is set, nor when a recorded field is gone."""
    p = small_protocol()
    current = protocol.resolved_config(protocol.primary_runs(p)[0], p)
    assert current["snip"]["probe_micro_batch_size"] == 0  # a default
    older = copy.deepcopy(current)
    del older["snip"]["probe_micro_batch_size"]  # recorded before the field was added
    assert protocol.same_config(older, current)
    changed = copy.deepcopy(current)
    changed["snip"]["probe_micro_batch_size"] = 2
    assert not protocol.same_config(older, changed)
    removed = copy.deepcopy(current)
    removed["snip"]["a_field_since_removed"] = 1
    assert not protocol.same_config(removed, current)
    assert not protocol.same_config(None, current)


def test_a_base_run_ignores_the_snip_section():
    """A base run trains with SNIP off: a record whose snip fields differ (an ablation's --set) still
    counts as done, one with another model does not; a SNIP run's snip fields always count."""
    p = small_protocol(seeds=(1,), base_steps=4)
    ablation = small_protocol(seeds=(1,), base_steps=4, overrides=(*p.overrides, "snip.granularity=layer"))
    base = protocol.base_run(1)
    latest = {base.name: {"name": base.name, "status": "ok", "config": protocol.resolved_config(base, p)}}
    assert store.is_done(base, ablation, latest)
    wider = small_protocol(seeds=(1,), base_steps=4, overrides=(*p.overrides, "model.hidden_size=128"))
    assert not store.is_done(base, wider, latest)
    snip = next(s for s in protocol.primary_runs(p) if s.policy == "snip")
    latest[snip.name] = {"name": snip.name, "status": "ok", "config": protocol.resolved_config(snip, p)}
    assert store.is_done(snip, p, latest) and not store.is_done(snip, ablation, latest)


def test_rerun_skips_only_finished_runs_with_the_same_config(tmp_path, monkeypatch):
    p = small_protocol(seeds=(1,), policies=("bf16", "uniform:fp8", "snip", "random"), format_sets=(MX,))
    specs = protocol.primary_runs(p)
    a, b, c, d = specs
    results = tmp_path / "results.jsonl"
    stale = protocol.resolved_config(c, p)
    stale["training"]["lr"] *= 2
    records = [{"name": a.name, "status": "ok", "config": protocol.resolved_config(a, p)},
               {"name": b.name, "status": "failed", "config": protocol.resolved_config(b, p)},
               {"name": c.name, "status": "ok", "config": stale},
               {"name": d.name, "status": "ok", "config": protocol.resolved_config(d, p)},
               {"name": d.name, "status": "timeout", "config": protocol.resolved_config(d, p)}]  # latest wins
    results.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"name": "torn')  # a torn last line
    calls = []

    def fake_execute(spec, p_, out_dir, **kw):
        calls.append(spec.name)
        return {"name": spec.name, "status": "ok", "config": protocol.resolved_config(spec, p_), "wall_s": 1.0}

    monkeypatch.setattr(runner, "execute", fake_execute)
    runner.run_all(specs, p, tmp_path, jobs=2, threads=1, timeout_s=10, log=lambda *_: None)
    assert sorted(calls) == sorted([b.name, c.name, d.name])
    calls.clear()
    runner.run_all(specs, p, tmp_path, jobs=1, threads=1, timeout_s=10, log=lambda *_: None)
    assert calls == []  # everything is done now
    latest = store.latest_records(store.read_results(results))
    assert all(store.is_done(s, p, latest) for s in specs)
    assert {r["name"] for r in store.current_results(p, store.read_results(results))} == {s.name for s in specs}
    changed = small_protocol(seeds=(1,), policies=p.policies, format_sets=(MX,), steps=6)
    assert not any(store.is_done(s, changed, latest) for s in protocol.primary_runs(changed))  # other steps: rerun


# --- statistics and report ----------------------------------------------------------------
BF16 = {1: 2.00, 2: 2.10, 3: 2.05}
SNIP = {1: 2.03, 2: 2.11, 3: 2.09}
LAYER = {1: 2.06, 2: 2.12}  # one seed missing: pairs over seeds 1 and 2 only


def _fake_run(tmp: Path, name: str, policy: str, formats, rho, seed: int, final: float, share) -> dict:
    run_dir = tmp / "runs" / name
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "loss": 3.0 - 0.1 * s + 0.01 * seed, "fp4_share": share or 0.0} for s in range(1, 5)]
    lines[1].update(val_loss=final + 0.5, val_loss_moby_dick=final + 0.6)
    lines[3].update(val_loss=final - 0.3, val_loss_moby_dick=final)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if policy == "snip":
        (run_dir / "plans").mkdir()
        for step in (0, 1, 3):  # the initial plan, the first and the last re-plan
            (run_dir / "plans" / f"step_{step:06d}.png").write_bytes(b"\x89PNG fake %d" % step)
        (run_dir / "timeline.png").write_bytes(b"\x89PNG timeline")
    return {"name": name, "policy": policy, "formats": formats, "rho": rho, "seed": seed, "status": "ok",
            "run_dir": str(run_dir), "final": {"val_loss": final - 0.3, "val_loss_moby_dick": final},
            "fp4_share": share, "params_m": 0.12, "wall_s": 10.0, "train_s": 8.0, "replan_s": 0.5}


def fake_results(tmp: Path) -> list[dict]:
    out = [_fake_run(tmp, f"bf16_seed{s}", "bf16", None, None, s, v, 0.0) for s, v in BF16.items()]
    out += [_fake_run(tmp, f"snip_seed{s}", "snip", list(MX), 0.75, s, v, 0.76) for s, v in SNIP.items()]
    out += [_fake_run(tmp, f"lt_seed{s}", "layer_type", list(MX), 0.75, s, v, 0.8) for s, v in LAYER.items()]
    out += [_fake_run(tmp, f"snip05_seed{s}", "snip", list(MX), 0.5, s, v - 0.01, 0.5) for s, v in SNIP.items()]
    out += [_fake_run(tmp, f"lt05_seed{s}", "layer_type", list(MX), 0.5, s, v, 0.55) for s, v in LAYER.items()]
    return out


def test_aggregate_mean_std_and_paired_difference(tmp_path):
    rows = {(r.policy, r.rho): r for r in aggregate.aggregate(fake_results(tmp_path), "val_loss_moby_dick")}
    snip, lt, ref = rows[("snip", 0.75)], rows[("layer_type", 0.75)], rows[("bf16", None)]
    assert ref.mean == pytest.approx(statistics.mean(BF16.values()))
    assert snip.n == 3 and snip.mean == pytest.approx(statistics.mean(SNIP.values()))
    assert snip.std == pytest.approx(statistics.stdev(SNIP.values()))  # sample std (n-1)
    diffs = [SNIP[s] - BF16[s] for s in (1, 2, 3)]
    assert snip.paired_mean == pytest.approx(statistics.mean(diffs))
    assert snip.paired_std == pytest.approx(statistics.stdev(diffs))
    assert snip.gap_pct == pytest.approx(100 * (statistics.mean(SNIP.values()) / statistics.mean(BF16.values()) - 1))
    lt_diffs = [LAYER[s] - BF16[s] for s in (1, 2)]
    assert lt.n_pairs == 2 and lt.paired_mean == pytest.approx(statistics.mean(lt_diffs))
    assert lt.paired_std == pytest.approx(statistics.stdev(lt_diffs))
    assert snip.fp4_share == pytest.approx(0.76)
    assert next(r.policy for r in aggregate.aggregate(fake_results(tmp_path / "b"), "val_loss")) == "bf16"


def test_report_from_fake_results(tmp_path):
    results = fake_results(tmp_path)
    p = small_protocol(seeds=(1, 2, 3), format_sets=(MX,), sweep_rhos=(0.5, 0.75), sweep_format_sets=(MX,))
    report = report_writer.write_report(results, p, tmp_path / "docs" / "results.md",
                                        command="python -m experiments.compare_policies X")
    text = report.read_text()
    assert "python -m experiments.compare_policies X" in text.split("## Protocol")[0]
    # the snip row on the other domain: mean ± std, gap to BF16, paired difference ± SE (3 pairs)
    sm, ss = statistics.mean(SNIP.values()), statistics.stdev(SNIP.values())
    diffs = [SNIP[s] - BF16[s] for s in (1, 2, 3)]
    gap = 100 * (sm / statistics.mean(BF16.values()) - 1)
    row = f"| snip | fp8,mxfp4 | 0.75 | 0.760 | 3 | {sm:.4f} ± {ss:.4f} | {gap:+.2f}% | " \
          f"{statistics.mean(diffs):+.4f} ± {statistics.stdev(diffs) / 3 ** 0.5:.4f} (3) |"  # ± SE
    other = text.split("### other domain: moby_dick")[1].split("###")[0]
    assert row in other
    # other domains come before the training domain (headline first)
    assert text.index("### other domain: moby_dick") < text.index("### training domain")
    # the sweep compares snip with the best static baseline by training-domain loss, paired by seed
    assert "-> layer_type" in text
    sweep = text.split("## rho sweep")[1].split("### training domain")[0]
    d05 = [SNIP[s] - 0.01 - LAYER[s] for s in (1, 2)]
    assert f"{statistics.mean(d05):+.4f} ± {statistics.stdev(d05) / 2 ** 0.5:.4f} (2)" in sweep
    assert "PLACEHOLDER" in text.split("## What this shows")[1]
    # a hand-written discussion next to the report replaces the placeholder and survives regeneration
    (tmp_path / "docs" / report_writer.DISCUSSION_FILE).write_text("SNIP ties BF16 here because of X.\n")
    text = report_writer.write_report(results, p, report, command="python -m experiments.compare_policies X").read_text()
    assert text.split("## What this shows")[1].strip() == "SNIP ties BF16 here because of X."
    figs = tmp_path / "docs" / "figures"
    assert (figs / "compare_curves_fp8-mxfp4.png").stat().st_size > 1000
    assert (figs / "compare_snip_first_replan_fp8-mxfp4_rho0.75_seed1.png").read_bytes() == b"\x89PNG fake 1"
    assert (figs / "compare_snip_last_replan_fp8-mxfp4_rho0.75_seed1.png").read_bytes() == b"\x89PNG fake 3"
    assert "snip first re-plan (step 1)" in text and "snip last re-plan (step 3)" in text
    assert "figures/compare_curves_fp8-mxfp4.png" in text


def write_report_inputs(docs: Path) -> None:
    """What the report reads besides the records: a benchmark JSON, the validation summary, the discussion."""
    (docs / "validation").mkdir(parents=True)
    (docs / "overheads.json").write_text(json.dumps({
        "command": "python -m experiments.bench.overheads --reps 5", "compiled_quantizers": True,
        "machine": {"torch_threads": 1, "load_avg_at_start": [0.5, 0.4, 0.3]},
        "replan": {"model": "tiny", "replan_s": 6.96, "stats_s": 6.6, "metrics_s": 0.0003, "solve_s": 0.003,
                   "replan_over_step": 11.6, "step_s": 0.6, "interval": 100, "pct_of_training_at_interval": 8.6},
        "emulation": {"formats": {"nvfp4": {"step_s": 0.745, "ratio": 1.23}, "mxfp4": {"error": "NotImplementedError: x"}}},
        "ilp": {"rows": [{"granularity": "gemm", "layers": 80, "units": 960, "status": "OPTIMAL", "solve_s": 0.11}]}}))
    (docs / "validation" / "summary.md").write_text("Spearman rank correlation.\n\n# A heading\n\n| a | b |\n|---|---|\n")
    (docs / report_writer.DISCUSSION_FILE).write_text("Hand-written conclusions.\n")


def test_report_text_is_unchanged_by_the_split(tmp_path, monkeypatch):
    """The whole report on constructed records, against data/report_expected.md (first written by
    the single-file driver before the split; changed since only on purpose, with the diff reviewed:
    per-set rhos, the SNIP-vs-every-policy tables, first and last re-plan maps), so a report
    regenerates identically from the recorded runs."""
    results = fake_results(tmp_path)
    write_report_inputs(tmp_path / "docs")
    p = small_protocol(seeds=(1, 2, 3), format_sets=(MX,), sweep_rhos=(0.5, 0.75), sweep_format_sets=(MX,))
    records = results + [dict(results[0], name="x_seed1", status="failed")]
    expected = (Path(__file__).parent / "data" / "report_expected.md").read_text()
    monkeypatch.chdir(tmp_path)  # a relative report path, as the driver's default docs/results.md
    text = report_writer.write_report(results, p, Path("docs/results.md"),
                                      command="python -m experiments.compare_policies X", all_records=records).read_text()
    assert text == expected



def test_report_in_a_study_folder_reads_the_shared_inputs(tmp_path, monkeypatch):
    """The driver's layout: the report in docs/results/<study>/ (its discussion and figures beside it),
    the benchmark JSON and the validation summary passed from where they live: the same text as
    data/report_expected.md, which was written with all three beside the report."""
    results = fake_results(tmp_path)
    write_report_inputs(tmp_path / "docs")
    study = tmp_path / "docs" / "results" / "comparison"
    study.mkdir(parents=True)
    (tmp_path / "docs" / report_writer.DISCUSSION_FILE).rename(study / report_writer.DISCUSSION_FILE)
    p = small_protocol(seeds=(1, 2, 3), format_sets=(MX,), sweep_rhos=(0.5, 0.75), sweep_format_sets=(MX,))
    records = results + [dict(results[0], name="x_seed1", status="failed")]
    expected = (Path(__file__).parent / "data" / "report_expected.md").read_text()
    monkeypatch.chdir(tmp_path)
    text = report_writer.write_report(results, p, Path("docs/results/comparison/results.md"),
                                      command="python -m experiments.compare_policies X", all_records=records,
                                      overheads=Path("docs/overheads.json"),
                                      validation=Path("docs/validation")).read_text()
    assert text == expected
    assert report_writer.OVERHEADS_JSON == Path("docs/overheads.json")
    assert report_writer.VALIDATION_DIR == Path("docs/results/validation")

# --- one real end-to-end run through the subprocess path ----------------------------------------
def _small_corpus(path: Path, first_doc: int, n_docs: int) -> Path:
    """A few KB of real text (slices of the bundled sample) so the runs tokenize in no time."""
    from megatron_snip.data.corpus import bundled_sample_path, read_jsonl

    texts = [t[:3000] for t in list(read_jsonl(bundled_sample_path("sotu")))[first_doc:first_doc + n_docs]]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_end_to_end_bf16_and_snip(tmp_path, capsys):
    out, report = tmp_path / "cmp", tmp_path / "docs" / "results.md"
    train = _small_corpus(tmp_path / "speeches.jsonl", 0, 20)
    other = _small_corpus(tmp_path / "later.jsonl", 100, 4)
    argv = [*(a for s in SMALL_SETS for a in ("--set", s)), "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--steps", "3", "--warmup", "1", "--interval", "1", "--eval-interval", "3", "--eval-batches", "1",
            "--seeds", "1", "--policies", "bf16;snip", "--format-sets", "fp8,nvfp4", "--no-sweep",
            "--train-corpus", str(train), "--valid-corpus", f"later={other}", "--valid-corpus", "python_docs=",
            "--jobs", "2", "--timeout", "120",
            "--out-dir", str(out), "--report", str(report)]
    assert cli.main(argv) == 0
    recs = {r["policy"]: r for r in store.read_results(out / "results.jsonl")}
    assert set(recs) == {"bf16", "snip"}
    for r in recs.values():
        assert r["status"] == "ok", r.get("log_tail")
        assert r["last_step"] == 3 and set(r["final"]) == {"val_loss", "val_loss_moby_dick", "val_loss_later"}
        assert r["replans"] == 2  # at steps 1 and 2 (warmup 1, interval 1)
        assert not (Path(r["run_dir"]) / "checkpoints").exists()
        assert (Path(r["run_dir"]) / "train.log").is_file()
        assert r["machine"] == runner.machine()  # which CPU kernels made these losses
    assert recs["bf16"]["fp4_share"] == 0.0
    assert recs["snip"]["fp4_share"] >= 0.75
    text = report.read_text()
    # the report counts the protocol's parameters itself; the trainer's own count agrees
    logged = re.search(r"model: ([0-9.]+)M parameters", (Path(recs["bf16"]["run_dir"]) / "train.log").read_text())
    assert f", {logged.group(1)}M parameters." in text.split("## Primary")[0]
    assert text.index("`val_loss_later`") < text.index("training domain: held-out documents of")
    assert "| snip | fp8,nvfp4 | 0.75 |" in text and "compare_snip_first_replan_fp8-nvfp4_rho0.75_seed1.png" in text
    capsys.readouterr()
    assert cli.main(argv) == 0  # a rerun trains nothing
    assert "skipping 2 finished run(s)" in capsys.readouterr().out
    assert len(store.read_results(out / "results.jsonl")) == 2


def test_the_dry_list_prices_a_truth_replan_by_its_measured_batches():
    """The truth oracle's re-plan costs ~190 BF16 steps per measured micro-batch, so its estimate
    grows with snip.truth_batches and dwarfs SNIP's."""
    def truth_s(batches):
        p = dataclasses.replace(small_protocol(), overrides=small_protocol().overrides + (f"snip.truth_batches={batches}",))
        return CostModel(step_s=1.0).run_s(protocol.RunSpec(1, "truth", NV, 0.75), p), p

    (two, p), (eight, _) = truth_s(2), truth_s(8)
    replans = len(range(p.warmup, p.steps, p.interval))
    assert eight - two == pytest.approx(replans * 6 * 190.0)
    assert two > CostModel(step_s=1.0).run_s(protocol.RunSpec(1, "snip", NV, 0.75), p)
