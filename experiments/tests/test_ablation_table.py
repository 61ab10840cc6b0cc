"""experiments/ablation_table.py on hand-made records: paired Δ against the reference and BF16, the
> 2 SE mark, and clear errors for a bad --row or a missing out-dir."""

from __future__ import annotations

import json

import pytest

from experiments import ablation_table


def _records(out_dir, runs, rho=None):
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"name": f"{p}_{s}_{rho}", "policy": p, "formats": f, "rho": rho if f else None, "seed": s,
                         "status": st, "final": {"val_loss": v}}) for p, f, s, v, st in runs]
    (out_dir / "results.jsonl").write_text("\n".join(lines) + "\n")


def test_paired_rows_against_the_reference_and_bf16(tmp_path):
    fs = ["fp8_block", "fp4_block"]
    _records(tmp_path / "main", [("bf16", None, s, 1.0, "ok") for s in (1, 2, 3)]
             + [("snip", fs, s, 1.0 + d, "ok") for s, d in ((1, 0.010), (2, 0.012), (3, 0.011))])
    _records(tmp_path / "var", [("snip", fs, s, 1.0 + d, "ok") for s, d in ((1, 0.020), (2, 0.023), (3, 0.021))]
             + [("snip", fs, 4, 9.0, "failed")])  # a failed run does not count
    text = ablation_table.table([ablation_table.Row.parse(f"default={tmp_path / 'main'}:snip:fp8_block,fp4_block"),
                                 ablation_table.Row.parse(f"variant={tmp_path / 'var'}:snip:fp8_block,fp4_block")],
                                tmp_path / "main")
    default, variant = text.splitlines()[2:]
    assert "reference" in default and "+0.0110" in default  # Δ vs BF16: mean of 0.010, 0.012, 0.011
    # differences 0.010, 0.011, 0.010: mean 0.01033, sample std 0.000577, SE 0.000333
    assert "+0.0103 ± 0.0003 (3) **(> 2 SE)**" in variant and "1,2,3" in variant


def test_no_verdict_from_two_pairs(tmp_path):
    fs = ["fp8_block", "fp4_block"]
    _records(tmp_path / "main", [("snip", fs, s, 1.0, "ok") for s in (1, 2)])
    _records(tmp_path / "var", [("snip", fs, 1, 1.010, "ok"), ("snip", fs, 2, 1.011, "ok")])
    text = ablation_table.table([ablation_table.Row.parse(f"a={tmp_path / 'main'}:snip:fp8_block,fp4_block"),
                                 ablation_table.Row.parse(f"b={tmp_path / 'var'}:snip:fp8_block,fp4_block")], None)
    assert "+0.0105 ± 0.0005 (2)" in text and "2 SE" not in text


def test_several_targets_need_a_rho(tmp_path):
    """An out-dir with runs at two FP4 targets (as docs/results/comparison/): without @RHO the table refuses to
    mix them; with it, it takes that target's runs only."""
    fs = ["fp8_block", "fp4_block"]
    _records(tmp_path / "main", [("snip", fs, s, 1.0, "ok") for s in (1, 2, 3)], rho=0.8)
    with (tmp_path / "main" / "results.jsonl").open("a") as f:
        f.writelines(json.dumps({"name": f"snip_{s}_0.75", "policy": "snip", "formats": fs, "rho": 0.75, "seed": s,
                                 "status": "ok", "final": {"val_loss": 2.0}}) + "\n" for s in (1, 2, 3))
    _records(tmp_path / "var", [("snip", fs, s, 1.01, "ok") for s in (1, 2, 3)], rho=0.8)
    with pytest.raises(ValueError, match=r"several FP4 targets \[0.75, 0.8\].*@RHO"):
        ablation_table.table([ablation_table.Row.parse(f"a={tmp_path / 'main'}:snip:fp8_block,fp4_block"),
                              ablation_table.Row.parse(f"b={tmp_path / 'var'}:snip:fp8_block,fp4_block")], None)
    text = ablation_table.table([ablation_table.Row.parse(f"a={tmp_path / 'main'}:snip:fp8_block,fp4_block@0.8"),
                                 ablation_table.Row.parse(f"b={tmp_path / 'var'}:snip:fp8_block,fp4_block@0.8")], None)
    assert "+0.0100 ± 0.0000 (3)" in text


def test_a_policy_with_an_argument_keeps_its_colon():
    row = ablation_table.Row.parse("u=dir:uniform:fp4_block")
    assert (row.policy, row.formats) == ("uniform:fp4_block", None)
    row = ablation_table.Row.parse("s=dir:snip:fp8_block,fp4_block@0.8")
    assert (row.policy, row.formats, row.rho) == ("snip", ("fp8_block", "fp4_block"), 0.8)


@pytest.mark.parametrize("bad", ["noname", "x=dir", "x=:snip", "=dir:snip", "x=dir:snip:fp8@high"])
def test_a_bad_row_is_named(bad):
    with pytest.raises(ValueError, match="--row"):
        ablation_table.Row.parse(bad)


def test_a_missing_out_dir_is_named(tmp_path, capsys):
    assert ablation_table.main(["--row", f"a={tmp_path / 'nowhere'}:snip"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_seeds_keep_a_subset_and_an_absent_seed_is_named(tmp_path, capsys):
    """--seeds reports a study extended by more seeds on the added ones alone: only those pairs count."""
    fs = ["fp8_block", "fp4_block"]
    _records(tmp_path / "main", [("bf16", None, s, 1.0, "ok") for s in (1, 2, 41, 42)]
             + [("snip", fs, s, 1.0, "ok") for s in (1, 2, 41, 42)])
    _records(tmp_path / "var", [("snip", fs, s, 1.0 + d, "ok") for s, d in ((1, 0.5), (2, 0.5), (41, 0.010), (42, 0.012))])
    rows = [ablation_table.Row.parse(f"a={tmp_path / 'main'}:snip:fp8_block,fp4_block"),
            ablation_table.Row.parse(f"b={tmp_path / 'var'}:snip:fp8_block,fp4_block")]
    variant = ablation_table.table(rows, tmp_path / "main", frozenset({41, 42})).splitlines()[3]
    assert "41,42" in variant and "+0.0110 ± 0.0010 (2)" in variant and "0.5" not in variant
    with pytest.raises(ValueError, match=r"--seeds 41,43: no row has a run of seed\(s\) 43"):
        ablation_table.table(rows, None, frozenset({41, 43}))
    with pytest.raises(SystemExit):
        ablation_table.main(["--row", f"a={tmp_path / 'main'}:snip", "--seeds", "41,x"])
    assert "41,x" in capsys.readouterr().err
