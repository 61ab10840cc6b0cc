"""Bad run inputs from issue #26, section 2: seeds, a directory as --config, plan files that do not
match the model, an evaluation longer than its held-out split. Each error names the field or
file, the value and the fix."""

from __future__ import annotations

import json
import re

import pytest

from megatron_snip import train as train_cli
from megatron_snip.config import load_config
from megatron_snip.model.shapes import linear_numel, model_linear_shapes
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


@pytest.mark.parametrize("override, field", [("training.seed=-1", "training.seed"), ("snip.seed=-1", "snip.seed"),
                                             ("training.seed=4294967296", "training.seed")])
def test_out_of_range_seeds_name_the_field(override, field):
    with pytest.raises(ValueError, match=rf"config {field}=.*: must be an integer in \[0, 2\*\*32\)"):
        load_config(TINY, [override])


def test_config_that_is_a_directory(capsys):
    assert train_cli.main(["--config", "launch/configs"]) == 2
    err = capsys.readouterr().err
    assert "config file 'launch/configs' is a directory; give a TOML file in it" in err and "does not exist" not in err


@pytest.mark.parametrize("edit, words", [
    ("unknown", r"1 'entries' key\(s\) name no GEMM of this model, e.g. \['9.qkv.fprop'\]"),
    ("missing", r"1 of its GEMMs have no entry, e.g. \['0.fc2.wgrad'\]"),
    ("empty", r"0 entries\) does not match the model \(2 layers x 4 linears x 3 GEMMs = 24 entries\)"),
])
def test_plan_file_not_matching_the_model_names_file_field_and_entries(small_overrides, tmp_path, edit, words):
    cfg = load_config(TINY, small_overrides)
    plan = json.loads(PrecisionPlan.uniform("bf16", 2, linear_numel(model_linear_shapes(cfg.model))).to_json())
    plan.pop("hash")
    if edit == "unknown":
        plan["entries"]["9.qkv.fprop"] = "bf16"
    elif edit == "missing":
        del plan["entries"]["0.fc2.wgrad"]
    else:
        plan["entries"] = {}
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    with pytest.raises(ValueError) as e:
        Trainer(load_config(TINY, small_overrides + [f"precision.initial_plan={p}"]))
    msg = str(e.value)
    assert msg.startswith(f"config precision.initial_plan='{p}': precision plan"), msg
    assert "regenerate the plan for this model's num_layers" in msg
    assert re.search(words, msg), msg


def test_eval_batches_beyond_the_held_out_split_are_refused(small_overrides):
    with pytest.raises(ValueError, match=r"config training.eval_batches=5000 x training.micro_batch_size=4 = 20000 "
                                         r"sequences, but the held-out split of data.train_path has only \d+ windows "
                                         r"of training.seq_len=32 tokens; set training.eval_batches <= \d+"):
        Trainer(load_config(TINY, small_overrides + ["training.eval_batches=5000"]))
