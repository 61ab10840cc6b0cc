"""Bad or hostile inputs each end in one clear message naming the field or file, the value and
the fix - never a traceback, a hang or a silently wrong result (issue #17, items 5-10)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_snip import train as train_cli
from megatron_snip.config import load_config
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.trainer import Trainer, TrainingStopped

TINY = "launch/configs/tiny.toml"


def _argv(overrides):
    return ["--config", TINY, *[a for o in overrides for a in ("--set", o)]]


# --- item 5: non-finite config values --------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("training.lr=inf", "training.lr"),
    ("training.weight_decay=nan", "training.weight_decay"),
    ("training.grad_clip=nan", "training.grad_clip"),
    ("training.min_lr=nan", "training.min_lr"),
    ("model.rope_base=nan", "model.rope_base"),
    ("model.norm_eps=inf", "model.norm_eps"),
    ("training.adam_eps=inf", "training.adam_eps"),
    ("model.init_std=1e20", "model.init_std"),
    ("snip.weight_divergence_weight=nan", "snip.weight_divergence_weight"),
    ("snip.solver_max_time=nan", "snip.solver_max_time"),
])
def test_non_finite_config_values_are_refused(override, field):
    with pytest.raises(ValueError, match=rf"config {field}=.*(finite|must be in \(0, 1\])"):
        load_config(TINY, [override])


# --- item 6: a finite but ruinous update -------------------------------------------------------
def test_huge_update_stops_before_the_weights_are_saved(small_overrides, tmp_path, capsys):
    over = small_overrides + ["training.max_steps=6", "training.save_interval=2", "training.lr=1e6",
                              "training.min_lr=0", "training.warmup_steps=0"]
    code = train_cli.main(_argv(over))
    err = capsys.readouterr().err
    assert code == train_cli.EXIT_STOPPED
    assert "error: training stopped: step 0: the optimizer update took the parameter norm from" in err
    assert "stopped before these weights were saved - no checkpoint (none was saved yet)" in err
    assert "Lower training.lr (now 1000000.0)" in err and "Traceback" not in err
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_update_guard_names_the_last_good_checkpoint(small_overrides, tmp_path, monkeypatch):
    tr = Trainer(load_config(TINY, small_overrides + ["training.max_steps=4", "training.save_interval=2"]))
    for _ in range(2):
        tr.train_step(tr.step)
        tr.step += 1
    tr.save()
    good = {k: v.clone() for k, v in tr.model.state_dict().items()}
    monkeypatch.setattr("megatron_snip.training.trainer.lr_at", lambda step, cfg: 1e6)
    with pytest.raises(TrainingStopped, match=r"step 2: .* the last checkpoint \(step 2, .*step_000002\) holds good"):
        tr.fit()
    tr.logger.close()
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [2]
    state = ckpt.read_shard(tmp_path / "run" / "checkpoints", 2)
    assert all(torch.equal(good[k], state["model"][k]) for k in good)
    assert max(float(p.detach().abs().max()) for p in tr.model.parameters()) > 1e3  # the bad update happened in memory


def test_consecutive_non_finite_steps_exit_non_zero_with_a_message(small_overrides, capsys, monkeypatch):
    real = Trainer._stage_forward  # every schedule's forward of one micro-batch
    monkeypatch.setattr(Trainer, "_stage_forward", lambda self, tokens, x: real(self, tokens, x) * float("nan"))
    over = small_overrides + ["training.max_steps=6", "training.max_consecutive_skips=2"]
    code = train_cli.main(_argv(over))
    err = capsys.readouterr().err
    assert code == train_cli.EXIT_STOPPED
    assert "error: training stopped: 2 consecutive non-finite steps (training.max_consecutive_skips=2)" in err
    assert "Traceback" not in err


# --- item 7: non-finite SNIP statistics --------------------------------------------------------
def test_non_finite_snip_statistics_keep_the_previous_plan(small_overrides, monkeypatch, capsys):
    from megatron_snip.snip import controller as ctl
    from megatron_snip.training.run import run_training

    real = ctl.policy_costs

    def poisoned(*args, **kwargs):
        costs = real(*args, **kwargs)
        first = next(iter(costs))
        costs[first] = {f: math.nan for f in costs[first]}
        return costs

    monkeypatch.setattr(ctl, "policy_costs", poisoned)
    cfg = load_config(TINY, small_overrides + ["training.max_steps=3", "snip.enabled=true", "snip.warmup=1",
                                               "snip.interval=100", "snip.fp4_target=0.5"])
    final = run_training(cfg)
    out = capsys.readouterr().out
    assert "re-plan at step 1: starting" in out
    assert "re-plan at step 1: non-finite SNIP statistics for 1 GEMM(s), e.g. ['0.qkv.fprop']; keeping the previous plan" in out
    assert math.isfinite(final["val_loss"])


# --- item 8: data files --------------------------------------------------------------------------
def _bin_corpus(tmp_path, tokens, dtype=np.uint16):
    from megatron_snip.data.indexed import IndexedDatasetBuilder

    prefix = tmp_path / "corpus" / "c"
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for i in range(8):
            b.add_document(np.asarray(tokens, dtype=dtype) + (0 if np.issubdtype(dtype, np.floating) else i % 2))
    return str(prefix)


def _data_error(small_overrides, *extra):
    with pytest.raises(ValueError) as e:
        Trainer(load_config(TINY, small_overrides + list(extra)))
    return str(e.value)


def test_plain_text_named_gz_names_the_file(small_overrides, tmp_path):
    p = tmp_path / "c.jsonl.gz"
    p.write_text('{"text": "hello"}\n')
    msg = _data_error(small_overrides, f"data.train_path={p}")
    assert f"{p}: not a valid gzip file" in msg and "drop the .gz suffix" in msg, msg


def test_random_bytes_jsonl_names_the_file(small_overrides, tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(bytes(range(128, 256)) * 8)
    msg = _data_error(small_overrides, f"data.train_path={p}")
    assert f"{p}:1: not UTF-8 text" in msg, msg


def test_binary_toml_names_the_file(tmp_path):
    p = tmp_path / "cfg.toml"
    p.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=rf"config file '{p}' is not UTF-8 text"):
        load_config(p)


@pytest.mark.parametrize("tokens, dtype, words", [
    (list(range(300, 400)), np.uint16, "token ids in [300, 400] but the tokenizer (data.tokenizer='byte') has ids [0, 257)"),
    (list(range(-5, 100)), np.int32, "token ids in [-5, 100]"),
    ([float(x) for x in range(100)], np.float32, "holds float32 values, not token ids"),
])
def test_token_files_the_model_cannot_use(small_overrides, tmp_path, tokens, dtype, words):
    prefix = _bin_corpus(tmp_path, tokens, dtype)
    msg = _data_error(small_overrides, f"data.train_path={prefix}")
    assert f"corpus {prefix!r}" in msg and words in msg, msg


def test_changed_dtype_byte_and_negative_length_are_named(tmp_path):
    from megatron_snip.data.indexed import IndexedDataset, idx_path

    prefix = _bin_corpus(tmp_path, list(range(100)), np.uint16)
    idx = Path(idx_path(prefix))
    raw = bytearray(idx.read_bytes())
    raw[17] = 4  # int32: pointers now disagree (2-byte tokens written)
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"dtype code 4 \(int32, 4-byte tokens\) disagrees with the sequence pointers, "
                                         r"which imply 2-byte tokens"):
        IndexedDataset(prefix)
    raw[17] = 8
    raw[34:38] = (-3).to_bytes(4, "little", signed=True)
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"sequence 0 has negative length -3"):
        IndexedDataset(prefix)


# --- item 9: paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["training.run_dir", "data.cache_dir"])
def test_directory_field_pointing_at_a_file(small_overrides, tmp_path, field):
    f = tmp_path / "a_file"
    f.write_text("x")
    over = [o for o in small_overrides if not o.startswith(field)] + [f"{field}={f}"]
    assert _data_error(over) == f"config {field}='{f}' is a file, not a directory; choose a directory path"


@pytest.mark.parametrize("field", ["training.run_dir", "data.cache_dir"])
def test_unwritable_directory_field(small_overrides, field):
    over = [o for o in small_overrides if not o.startswith(field)] + [f"{field}=/proc/megatron_snip_test"]
    msg = _data_error(over)
    assert msg.startswith(f"config {field}='/proc/megatron_snip_test' is not a writable directory") \
        and "choose a directory you can write to" in msg, msg


# --- item 10: plan files ---------------------------------------------------------------------------
def _plan_json(cfg):
    from megatron_snip.model.shapes import linear_numel, model_linear_shapes
    from megatron_snip.precision.plan import PrecisionPlan

    return json.loads(PrecisionPlan.uniform("bf16", cfg.model.num_layers,
                                            linear_numel(model_linear_shapes(cfg.model))).to_json())


@pytest.mark.parametrize("content, words", [
    ("5", "plan JSON is a number, not an object"),
    ('{"entries": [["0.qkv.fprop", "fp8"]]}', "'entries' is a list; it must be an object"),
    ("FORMAT_LIST", "plan entry 0.qkv.fprop=['fp8'] is not a known format name"),
    ("EXTRA_LIST", "plan JSON 'extra' is a list"),
    ("{not json", "is not valid JSON"),
    ("", "is empty"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not UTF-8 text"),
    ("STEP_ABC", "plan JSON 'step'='abc' must be a non-negative integer"),
    ("CLAIM", "claims fp4_flops_share=0.95 but its entries put 0.0000 of the linear-layer FLOPs in FP4"),
])
def test_bad_plan_files_name_the_file(small_overrides, tmp_path, content, words):
    cfg = load_config(TINY, small_overrides)
    good = _plan_json(cfg)
    good.pop("hash")
    if content == "FORMAT_LIST":
        good["entries"]["0.qkv.fprop"] = ["fp8"]
        content = json.dumps(good)
    elif content == "EXTRA_LIST":
        good["extra"] = [1, 2]
        content = json.dumps(good)
    elif content == "STEP_ABC":
        good["step"] = "abc"
        content = json.dumps(good)
    elif content == "CLAIM":
        good["fp4_flops_share"] = 0.95  # an all-bf16 plan claiming FP4
        content = json.dumps(good)
    p = tmp_path / "plan.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    msg = _data_error(small_overrides, f"precision.initial_plan={p}")
    assert f"precision plan file '{p}'" in msg and words in msg, msg


def test_bom_prefixed_plan_file_loads(small_overrides, tmp_path):
    cfg = load_config(TINY, small_overrides)
    p = tmp_path / "plan.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(_plan_json(cfg)).encode())
    tr = Trainer(load_config(TINY, small_overrides + [f"precision.initial_plan={p}"]))
    assert tr.plan.fp4_flops_share == 0.0
    tr.logger.close()


@pytest.mark.parametrize("make, words", [("dir", "is a directory"), ("txt", "does not exist")])
def test_plan_path_that_is_a_directory_or_missing(small_overrides, tmp_path, make, words):
    p = tmp_path / "plans"
    if make == "dir":
        p.mkdir()
    else:
        p = tmp_path / "plan.txt"
    msg = _data_error(small_overrides, f"precision.initial_plan={p}")
    assert f"precision plan file '{p}' {words}" in msg and "unknown policy" not in msg, msg
