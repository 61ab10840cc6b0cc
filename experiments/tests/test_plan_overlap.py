"""experiments/plan_overlap.py: the FP4 shares and overlaps it prints, from a synthetic out-dir."""

from __future__ import annotations

import json

import pytest

from experiments import plan_overlap

GEMMS = ("dgrad", "fprop", "wgrad")
LINEARS = ("qkv", "proj", "fc1", "fc2")


def _write_run(out_dir, policy: str, seed: int, protected: set[str]) -> dict:
    """One run whose final plan has every GEMM of 2 blocks in fp4_block except those of ``protected`` linears."""
    name = f"{policy}_seed{seed}"
    entries = {f"{layer}.{lin}.{g}": ("fp8_block" if f"{layer}.{lin}" in protected else "fp4_block")
               for layer in range(2) for lin in LINEARS for g in GEMMS}
    (out_dir / name / "plans").mkdir(parents=True)
    (out_dir / name / "plans" / "step_000220.json").write_text(json.dumps({"entries": entries}))
    return {"name": name, "policy": policy, "seed": seed, "formats": ["fp8_block", "fp4_block"], "status": "ok",
            "run_dir": f"runs/x/{name}", "final_plan": "plans/step_000220.json"}


@pytest.fixture
def out_dir(tmp_path):
    records = [_write_run(tmp_path, "snip", 1, {"0.fc2"}), _write_run(tmp_path, "snip", 2, {"0.fc2", "1.qkv"}),
               _write_run(tmp_path, "tail", 1, {"1.fc2"}), _write_run(tmp_path, "tail", 2, {"1.fc2", "1.qkv"})]
    failed = dict(records[0], status="failed", final_plan=None)  # an earlier failed attempt, then the rerun
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in [failed, *records]) + "\n")
    return tmp_path


def test_shares_and_overlaps(out_dir, capsys):
    assert plan_overlap.main(["--out-dir", str(out_dir), "--policies", "snip,tail"]) == 0
    page = capsys.readouterr().out
    assert "| 0.fc2 | 0.00 | 1.00 |" in page  # snip protects it on both seeds, tail on neither
    assert "| 1.qkv | 0.50 | 0.50 |" in page
    assert "| 1.fc2 | 1.00 | 0.00 |" in page
    # block 0: snip 3 of 4 linears in FP4 on both seeds; tail all 4
    assert "| 0 | 0.75 | 1.00 |" in page
    # seed 1: 21 FP4 GEMMs each, 18 shared -> 18 / 24
    assert "| 1 | 0.75 | 1.fc2 (dgrad, fprop, wgrad) | 0.fc2 (dgrad, fprop, wgrad) |" in page
    # seed 2: 18 each, 15 shared -> 15 / 21
    assert f"| 2 | {15 / 21:.2f} |" in page


def test_bad_inputs_name_the_fix(out_dir, capsys):
    assert plan_overlap.main(["--out-dir", str(out_dir), "--policies", "snip,bf16_ends"]) == 2
    assert "--policies bf16_ends: no ok run" in capsys.readouterr().err
    assert plan_overlap.main(["--out-dir", str(out_dir), "--policies", "snip"]) == 2
    assert "name at least two" in capsys.readouterr().err
    assert plan_overlap.main(["--out-dir", str(out_dir / "nowhere"), "--policies", "snip,tail"]) == 2
    assert "no driver records here" in capsys.readouterr().err
    (out_dir / "tail_seed2" / "plans" / "step_000220.json").unlink()
    assert plan_overlap.main(["--out-dir", str(out_dir), "--policies", "snip,tail"]) == 2
    assert "the final plan of run 'tail_seed2' is missing" in capsys.readouterr().err
