"""scripts/exp_probe_size.py (and the validate_metrics pieces it shares) on a 2-layer model:
the JSON it writes holds what its docstring promises, and the plan regrets obey what makes
them meaningful (the reference plan is optimal under the reference costs, so no plan beats it)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import exp_probe_size  # noqa: E402


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
