"""experiments/scale_trend.py on hand-made records: paired Δ, the recovered share and its
delta-method SE, and the change in SNIP's margin between sizes."""

import json
import math

import numpy as np
import pytest

from experiments import scale_trend

FORMATS = ["fp8_block", "fp4_block"]


def write_records(out_dir, losses):
    """losses: {policy: {seed: val_loss}} -> an out-dir's results.jsonl of ok records."""
    out_dir.mkdir(parents=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for policy, per_seed in losses.items():
            takes_formats = policy not in ("bf16", scale_trend.UNIFORM)
            f.writelines(json.dumps({
                    "name": f"{policy}-s{seed}", "status": "ok", "policy": policy, "seed": seed,
                    "formats": FORMATS if takes_formats else None, "rho": 0.8 if takes_formats else None,
                    "final": {"val_loss": loss}}) + "\n" for seed, loss in per_seed.items())
    return out_dir


def test_recovered_share_is_one_minus_the_ratio_of_mean_gaps_and_its_se_the_linearized_one():
    bf16 = {1: 1.00, 2: 1.10, 3: 0.90, 4: 1.05}
    uniform = {1: 1.020, 2: 1.118, 3: 0.921, 4: 1.069}
    snip = {1: 1.011, 2: 1.107, 3: 0.909, 4: 1.061}
    share, se, n = scale_trend.recovered_share(snip, uniform, bf16)
    d_snip = np.array([snip[s] - bf16[s] for s in bf16])
    d_uni = np.array([uniform[s] - bf16[s] for s in bf16])
    assert n == 4 and share == pytest.approx(1 - d_snip.sum() / d_uni.sum())
    # Delta method written the textbook way: Var(a/b) ~ (Var a - 2 r Cov(a,b) + r^2 Var b) / b^2, of means.
    r = d_snip.mean() / d_uni.mean()
    cov = np.cov(d_snip, d_uni, ddof=1) / 4
    assert se == pytest.approx(math.sqrt(cov[0, 0] - 2 * r * cov[0, 1] + r * r * cov[1, 1]) / d_uni.mean())


def test_a_policy_at_exactly_half_of_uniforms_gap_on_every_seed_recovers_half_with_no_spread():
    bf16 = {1: 1.0, 2: 2.0, 3: 3.0}
    uniform = {s: v + 0.01 * s for s, v in bf16.items()}
    half = {s: v + 0.005 * s for s, v in bf16.items()}
    share, se, n = scale_trend.recovered_share(half, uniform, bf16)
    assert (n, share) == (3, pytest.approx(0.5)) and se == pytest.approx(0.0, abs=1e-12)


def test_the_page_sets_sizes_side_by_side_and_the_margin_change_combines_ses(tmp_path):
    small = write_records(tmp_path / "small", {
        "bf16": {1: 1.0, 2: 1.0, 3: 1.0}, scale_trend.UNIFORM: {1: 1.02, 2: 1.021, 3: 1.019},
        "bf16_ends": {1: 1.015, 2: 1.016, 3: 1.014}, "random": {1: 1.016, 2: 1.015, 3: 1.014},
        "snip": {1: 1.010, 2: 1.012, 3: 1.011}})
    large = write_records(tmp_path / "large", {
        "bf16": {1: 2.0, 2: 2.0}, scale_trend.UNIFORM: {1: 2.001, 2: 2.003},
        "bf16_ends": {1: 2.0, 2: 2.001}, "random": {1: 2.002, 2: 2.0}, "snip": {1: 2.001, 2: 2.001}})
    text = scale_trend.page([("S", small), ("L", large)], tuple(FORMATS), 0.8)
    snip_row = next(line for line in text.splitlines() if line.startswith("| `snip` |"))
    assert "+0.0110 ± 0.0006 (3)" in snip_row and "+0.45 ±" in snip_row  # 1 - 0.011/0.020
    assert snip_row.endswith("| n/a |")  # L: uniform's gap +0.002 ± 0.001 is not > 2 SE
    ends_row = [line for line in text.splitlines() if line.startswith("| `bf16_ends` |")][-1]  # SNIP − table
    small_m, small_se = -0.004, 0.001 / math.sqrt(3)  # snip - bf16_ends on S: -0.005, -0.004, -0.003
    large_m, large_se = 0.0005, 0.0005  # on L: +0.001, 0.0
    assert f"{large_m - small_m:+.4f} ± {math.hypot(small_se, large_se):.4f}" in ends_row


def test_a_size_missing_a_policy_is_named_with_the_fix(tmp_path):
    only = write_records(tmp_path / "only", {"bf16": {1: 1.0}, scale_trend.UNIFORM: {1: 1.01}})
    with pytest.raises(ValueError, match=r"no ok runs of bf16_ends, random, snip .*--formats and --rho"):
        scale_trend.page([("S", only)], tuple(FORMATS), 0.8)
    assert scale_trend.main(["--size", "nonsense", "--formats", "a,b", "--rho", "0.8"]) == 2


def test_the_written_page_names_the_command_that_made_it(tmp_path):
    out_dir = write_records(tmp_path / "d", {
        "bf16": {1: 1.0}, scale_trend.UNIFORM: {1: 1.01}, "bf16_ends": {1: 1.0}, "random": {1: 1.0}, "snip": {1: 1.0}})
    argv = ["--size", f"S={out_dir}", "--formats", ",".join(FORMATS), "--rho", "0.8", "--out", str(tmp_path / "p.md")]
    assert scale_trend.main(argv) == 0
    assert f"python -m experiments.scale_trend --size S={out_dir} --formats" in (tmp_path / "p.md").read_text()


def test_references_come_from_another_out_dir_of_the_same_bases(tmp_path):
    """An ablation out-dir holding only SNIP reads bf16 and uniform from the out-dir it copied its
    bases from: the same figures as one out-dir holding all three."""
    refs = {"bf16": {1: 1.0, 2: 1.1}, scale_trend.UNIFORM: {1: 1.02, 2: 1.121}}
    snip = {"snip": {1: 1.01, 2: 1.109}}
    together = write_records(tmp_path / "together", {**refs, **snip})
    ref_dir, ablation = write_records(tmp_path / "refs", refs), write_records(tmp_path / "ablation", snip)
    policies = [scale_trend.UNIFORM, "snip"]
    split = scale_trend.page([("S", ablation)], tuple(FORMATS), 0.8, policies, references={"S": ref_dir})
    whole = scale_trend.page([("S", together)], tuple(FORMATS), 0.8, policies)
    assert f"references from `{ref_dir}`" in split
    tables = [line for line in split.splitlines() if line.startswith("| `")]
    assert tables == [line for line in whole.splitlines() if line.startswith("| `")] and len(tables) == 4
    with pytest.raises(ValueError, match=r"no ok runs of bf16, uniform:fp4_block .*--references"):
        scale_trend.page([("S", ablation)], tuple(FORMATS), 0.8, policies)
    with pytest.raises(ValueError, match=r"--references L: no --size of that name"):
        scale_trend.page([("S", ablation)], tuple(FORMATS), 0.8, policies, references={"L": ref_dir})
    argv = ["--size", f"S={ablation}", "--references", f"S={ref_dir}", "--formats", ",".join(FORMATS),
            "--rho", "0.8", "--policies", ";".join(policies), "--out", str(tmp_path / "p.md")]
    assert scale_trend.main(argv) == 0 and (tmp_path / "p.md").read_text().endswith(split[-40:])
    assert scale_trend.main(argv[:2] + ["--references", "S"] + argv[4:]) == 2
