"""docs/config_reference.md is what scripts/config_reference.py writes from the config dataclasses
(regenerate it with ``python scripts/config_reference.py`` after changing a field)."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config_reference.md"


def load_script():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_page_is_current():
    text = load_script().render()
    assert PAGE.read_text(encoding="utf-8") == text, \
        "docs/config_reference.md is stale: run `python scripts/config_reference.py` and commit the page"


def test_every_field_has_a_row_with_its_default_and_comment():
    """Each field of each section appears once, with its TOML default; a field's comment is copied
    (checked on fields whose comment sits above the declaration, at its end, and over two lines)."""
    from megatron_snip.config import Config

    ref = load_script()
    text = ref.render()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    names = [r.split("`")[1] for r in rows]
    expected = [f"{s}.{f.name}" for s, cls in ref.sections() for f in dataclasses.fields(cls)]
    assert names == expected and len(set(names)) == len(names)
    assert {s for s, _ in ref.sections()} == {f.name for f in dataclasses.fields(Config)}
    row = dict(zip(names, rows))
    assert "| `int` | `4` | transformer blocks |" in row["model.num_layers"]
    assert '`"emulated"`' in row["precision.backend"] and "Transformer Engine" in row["precision.backend"]
    assert "| `bool \\| str` | `false` |" in row["training.resume"] and '"auto"' in row["training.resume"]
    assert '`["fp8", "nvfp4"]`' in row["snip.formats"]
    docs = ref.field_docs(Config.__dataclass_fields__["snip"].default_factory)
    assert docs["probe_micro_batch_size"].startswith("Sequences per probe micro-batch; 0 = training.micro_batch_size.")
    assert docs["probe_micro_batch_size"].endswith("plans worse).")  # the second comment line too


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    ref = load_script()
    stale = tmp_path / "ref.md"
    stale.write_text("old\n")
    assert ref.main(["--check", "--out", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert ref.main(["--out", str(stale)]) == 0
    assert ref.main(["--check", "--out", str(stale)]) == 0
