"""experiments/validate_metrics.py's truth reliability, and experiments/exp_probe_size.py (which shares
validate_metrics' pieces) on a 2-layer model: the JSON it writes holds what its docstring
promises, and the plan regrets obey what makes them meaningful (the reference plan is optimal
under the reference costs, so no plan beats it)."""

from __future__ import annotations

import json
import math

import pytest

from experiments import exp_probe_size, validate_metrics


def _rows(per_linear_batches):
    """Rows as ground_truth writes them, one format, from per-batch dL_true values."""
    return [{"linear": f"0.l{i}", "format": "nvfp4", "per_batch": {"dL_true": v, "dW_true": v}}
            for i, v in enumerate(per_linear_batches)]


def test_truth_reliability_split_half():
    # Even and odd batches rank the 4 linears the same: perfectly reliable.
    same = _rows([[1, 1.1, 1, 1.1], [2, 2.1, 2, 2.1], [3, 3.1, 3, 3.1], [4, 4.1, 4, 4.1]])
    r = validate_metrics.truth_reliability(same, ("nvfp4",))
    assert r["nvfp4"]["dL_true"] == {"split_half": 1.0, "full": 1.0} and r["all"]["dW_true"]["split_half"] == 1.0
    # The odd batches rank them in reverse: ρ = -1, no reproducible ranking at all (reliability 0).
    reversed_ = _rows([[1, 4], [2, 3], [3, 2], [4, 1]])
    r = validate_metrics.truth_reliability(reversed_, ("nvfp4",))
    assert r["nvfp4"]["dL_true"] == {"split_half": -1.0, "full": 0.0}
    # Two middle linears swap between halves: ρ = 0.9, stepped up by Spearman-Brown to 2*0.9/1.9.
    partial = _rows([[1, 1], [2, 3], [3, 2], [4, 4], [5, 5]])
    r = validate_metrics.truth_reliability(partial, ("nvfp4",))
    assert r["nvfp4"]["dL_true"]["split_half"] == pytest.approx(0.9)
    assert r["nvfp4"]["dL_true"]["full"] == pytest.approx(1.8 / 1.9)


def test_probe_size_experiment_reports_settings(small_overrides, tmp_path):
    out = tmp_path / "probe_size.json"
    argv = ["--steps", "3", "--run-dir", str(tmp_path / "run"), "--truth-batches", "1", "--windows", "2",
            "--settings", "1x2x1,2x1x1", "--reference", "1x4x1", "--out", str(out)]
    for o in small_overrides:
        argv += ["--set", o]
    assert exp_probe_size.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["setting"] for r in result["results"]] == ["1x2x1", "2x1x1"]
    for row in result["results"]:
        assert row["sequences"] == 2 and len(row["windows"]) == 2
        for w in row["windows"]:
            assert 0.0 <= w["plan_agreement"] <= 1.0
            assert w["plan_regret"] >= -1e-9, "a plan beat the optimum of the costs it is scored by"
            for per_format in w["spearman"].values():
                assert all(math.isfinite(v) and -1.0 <= v <= 1.0 for v in per_format.values())
    assert set(result["results"][0]["spearman"]) == {"nvfp4", "mxfp4", "all"}
    assert result["baseline_regret"]["random"] >= -1e-9 and result["baseline_regret"]["min_rel_err"] >= -1e-9


def test_bad_setting_is_refused():
    with pytest.raises(SystemExit, match="PxSxD"):
        exp_probe_size.parse_setting("2x8")
    with pytest.raises(SystemExit, match=">= 1"):
        exp_probe_size.parse_setting("0x8x1")


def test_loss_divergence_experiment_splits_the_truth(small_overrides, tmp_path):
    """exp_loss_divergence on a 2-layer model: the truth's even and odd parts add up to it, every
    formula is scored against all three, a rerun reuses the measured truth, and the reported seeds
    are refused."""
    from experiments import exp_loss_divergence as ld

    out = tmp_path / "ld.json"
    argv = ["--seed", "21", "--steps", "3", "--run-root", str(tmp_path / "runs"), "--truth-batches", "2",
            "--windows", "1", "--settings", "1x1xerror", "--formats", "fp8,nvfp4", "--truth-formats", "nvfp4",
            "--out", str(out)]
    for o in small_overrides:
        argv += ["--set", o]
    assert ld.main(argv) == 0
    first = json.loads(out.read_text())
    for k, v in first["truth"].items():
        assert first["truth_even"][k] + first["truth_odd"][k] == pytest.approx(v, rel=1e-12, abs=1e-15)
    row = first["results"][1]
    assert row["setting"] == "1x1xerror" and set(row["spearman_vs_even"]) == set(ld.FORMULAS)
    assert ld.main(argv) == 0  # the truth of the same checkpoint is read back, not re-measured
    assert json.loads(out.read_text())["truth_per_batch"] == first["truth_per_batch"]
    # More probe-truth batches extend the measured ones (the first two are read back, one more measured).
    assert ld.main(argv + ["--probe-truth-batches", "1,3"]) == 0
    longer = json.loads(out.read_text())
    assert set(longer["probe_truth_curve"]) == {"1", "3"}
    for k, v in longer["probe_truth_per_batch"].items():
        assert len(v) == 3 and v[:2] == first["probe_truth_per_batch"][k]
    assert longer["results"][0] == first["results"][0]  # the 2-batch probe truth is unchanged
    assert "measured on N probe batches: 1: " in ld.summarize([str(out)])
    assert "| 21 | 1x1xerror |" in ld.summarize([str(out)])
    with pytest.raises(SystemExit, match="reported seeds"):
        ld.main(["--seed", "3", "--out", str(out)])
