"""``python -m megatron_snip.evaluate``: per-domain loss and perplexity of a checkpoint, checked
against the model's own loss on the same windows; plans; bad input. (At TP=2, on gloo:
tests/distributed/test_resume_layout.py.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import SMALL

from megatron_snip import evaluate
from megatron_snip.config import load_config
from megatron_snip.data.corpus import bundled_sample_path
from megatron_snip.data.dataset import GPTDataset, spread_windows
from megatron_snip.data.pipeline import open_indexed
from megatron_snip.data.tokenizer import build_tokenizer
from megatron_snip.model.llama import LlamaModel
from megatron_snip.training import reshard
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run on the bundled SOTU sample, checkpointed at step 3, with a uniform-nvfp4 plan."""
    tmp = tmp_path_factory.mktemp("evaluate")
    tr = Trainer(load_config(TINY, SMALL + [f"training.run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}",
                                            "training.max_steps=3", "precision.initial_plan=uniform:nvfp4"]))
    tr.fit()
    tr.logger.close()
    return tmp / "run"


def _reference_loss(run, corpus: str, sequences: int, micro: int, ids=None) -> float:
    """The checkpoint's weights in a plain LlamaModel (fp32, every GEMM bf16-plan = fp32 on CPU),
    mean of the per-batch mean losses over the first ``sequences`` windows of ``corpus`` (or the
    windows ``ids``, in batches of ``micro``)."""
    full = reshard.read_full(*reshard.resolve_checkpoint(run), with_optimizer=False)
    model = LlamaModel(full.cfg.model, full.vocab_size)
    model.load_state_dict(full.model)
    model.eval()
    ds = GPTDataset(open_indexed(corpus, build_tokenizer("byte"), full.cfg.data), full.cfg.training.seq_len,
                    build_tokenizer("byte").eod_id, shuffle=False)
    ids = np.arange(sequences, dtype=np.int64) if ids is None else ids
    batches = [ds.samples(ids[s : s + micro]) for s in range(0, len(ids), micro)]
    with torch.no_grad():
        losses = [float(model.loss(model(b[:, :-1]), b[:, 1:])) for b in batches]
    return sum(losses) / len(losses)


def test_evaluate_matches_the_models_loss_and_writes_json(trained, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", str(trained), "--valid-corpus", "moby=bundled:moby_dick",
                          "--max-sequences", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["step"] == 3 and report["plan"] == "bf16" and report["fp4_share"] == 0
    moby = report["domains"]["moby"]
    assert moby["sequences"] == 8 and moby["tokens"] == 8 * 32
    # The same module, weights and windows in the same order on one process: the same bits.
    assert moby["loss"] == _reference_loss(trained, bundled_sample_path("moby_dick"), 8, 4)
    assert moby["ppl"] == pytest.approx(math.exp(moby["loss"]), rel=1e-12)
    assert set(report["domains"]) == {"valid", "moby"}  # the run's held-out split too
    text = capsys.readouterr().out
    assert "moby" in text and "ppl" in text


def test_plan_choice_changes_the_numbers(trained, tmp_path):
    def loss(*extra):
        args = evaluate.parse_args(["--checkpoint", str(trained), "--no-held-out", "--max-sequences", "8",
                                    "--valid-corpus", "sotu=bundled:sotu", *extra])
        return evaluate.run(args)["domains"]["sotu"]["loss"]

    bf16, nvfp4, own = loss(), loss("--plan", "uniform:nvfp4"), loss("--plan", "checkpoint")
    assert nvfp4 != bf16 and own == nvfp4  # the checkpoint's own plan is uniform nvfp4


def test_spread_windows_reach_the_end_of_the_domain(trained):
    """``--windows spread`` reads windows over the whole domain (not its first pages): the same
    bits as the plain model on ``spread_windows`` of it, and another loss than the first windows'."""
    def report(*extra):
        args = evaluate.parse_args(["--checkpoint", str(trained), "--no-held-out", "--max-sequences", "8",
                                    "--valid-corpus", "moby=bundled:moby_dick", *extra])
        return evaluate.run(args)

    spread = report("--windows", "spread")
    assert spread["windows"] == "spread" and spread["domains"]["moby"]["sequences"] == 8
    cfg = load_config(str(trained / "config.toml"))  # the run's own (seq_len from SMALL)
    ds = GPTDataset(open_indexed(bundled_sample_path("moby_dick"), build_tokenizer("byte"), cfg.data),
                    cfg.training.seq_len, build_tokenizer("byte").eod_id, shuffle=False)
    ids = spread_windows(ds.num_windows, 8)
    assert ids[-1] > ds.num_windows * 7 // 8
    assert spread["domains"]["moby"]["loss"] == _reference_loss(trained, bundled_sample_path("moby_dick"), 8, 4, ids)
    assert spread["domains"]["moby"]["loss"] != report()["domains"]["moby"]["loss"]


@pytest.mark.parametrize("argv, needle", [
    (["--valid-corpus", "moby"], "give NAME=PATH"),
    (["--valid-corpus", "a=bundled:sotu", "--valid-corpus", "a=bundled:moby_dick"], "the name 'a' is taken"),
    (["--valid-corpus", "x=/nonexistent/file.jsonl"], "--valid-corpus x '/nonexistent/file.jsonl' is neither"),
    (["--no-held-out"], "nothing to evaluate"),
    (["--max-sequences", "-1"], "--max-sequences=-1"),
    (["--plan", "nope:7"], "nope"),
])
def test_bad_input_is_exit_2_with_the_reason(trained, capsys, argv, needle):
    assert evaluate.main(["--checkpoint", str(trained), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_missing_checkpoint_is_refused(tmp_path, capsys):
    assert evaluate.main(["--checkpoint", str(tmp_path / "none")]) == 2
    assert "--checkpoint=" in capsys.readouterr().err
