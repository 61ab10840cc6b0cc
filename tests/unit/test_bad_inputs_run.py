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


def test_a_candidate_that_cannot_block_a_gemm_is_refused_at_start_up(small_overrides):
    """ffn 776 is not a multiple of NVFP4's 16-element blocks: fc2's fprop and dgrad cannot run
    in it. Refused before the first step (it used to stop the run at the first re-plan)."""
    over = small_overrides + ["model.ffn_hidden_size=776", "snip.enabled=true", "snip.fp4_target=1.0",
                              'snip.formats=["fp8", "nvfp4"]']
    with pytest.raises(ValueError) as e:
        Trainer(load_config(TINY, over))
    msg = str(e.value)
    assert msg.startswith("config snip.formats=['fp8', 'nvfp4']") and "format 'nvfp4' cannot run GEMM(s) fc2.fprop, " \
        "fc2.dgrad of every layer" in msg and "size 776" in msg, msg
    assert "snip.fp4_target=1.0 could not be met either: the other candidates reach at most" in msg, msg
    assert "model.ffn_hidden_size" in msg and "drop the format from snip.formats" in msg, msg
    # the same shapes without nvfp4 among the candidates start
    Trainer(load_config(TINY, over[:-2] + ["snip.fp4_target=0.5", 'snip.formats=["fp8", "mxfp4"]',
                                           "model.ffn_hidden_size=768"])).logger.close()
