"""The route to the standard harness (README, "Evaluating checkpoints"): export a checkpoint with
scripts/convert_hf.py, then ``lm_eval --model hf`` on a local multiple-choice task file.

The task (4 questions, 2-3 choices, built here; no dataset hub) is scored the harness's way: each
choice's log-likelihood as a continuation (``" " + choice``) of the question, the answer being the
argmax. The reference is our own model on our own tokenizer's ids; the exported directory, read
by transformers, must give the same log-likelihoods (to 1e-4: logits agree to 1e-5 per token,
tests/unit/test_hf_interop.py, over continuations of at most ~12 tokens). Where ``lm_eval`` is
installed, the harness itself is run offline on the task file and its per-choice log-likelihoods
and accuracy must equal the reference's (same tolerance); where it is not, that part is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL

from megatron_snip.config import load_config
from megatron_snip.data.tokenizer import BPETokenizer
from megatron_snip.model.llama import LlamaModel
from megatron_snip.training import reshard
from megatron_snip.training.trainer import Trainer

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
TINY = "launch/configs/tiny.toml"
QUESTIONS = [
    {"question": "Fellow citizens of the", "choices": ["Senate", "banana", "ocean"], "answer": 0},
    {"question": "The state of the", "choices": ["Union", "kettle"], "answer": 0},
    {"question": "We the people of the United", "choices": ["States", "spoons", "clouds"], "answer": 0},
    {"question": "Mr. Speaker, Mr. Vice", "choices": ["President", "turnip"], "answer": 0},
]
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(folder: Path, name: str = "tiny_mc") -> Path:
    """A local lm_eval task: ``folder/<name>.jsonl`` (the questions) and ``folder/<name>.yaml``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data))
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-step BPE run (its tokenizer trained on the SOTU sample) exported to HF."""
    tmp = tmp_path_factory.mktemp("lm_eval_route")
    cfg = load_config(TINY, SMALL + [f"training.run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}",
                                     "training.max_steps=2", "data.tokenizer=bpe", "data.bpe_vocab_size=400",
                                     f"data.tokenizer_path={tmp / 'tokenizer.json'}"])
    tr = Trainer(cfg)
    tr.fit()
    tr.logger.close()
    out = tmp / "hf"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_hf.py"), "export", str(tmp / "run"),
                           "--out", str(out)], capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return tmp, out


def _our_logliks(tmp: Path) -> list[list[float]]:
    """Per question, per choice: sum of log p(continuation token | prefix) under our model, our ids."""
    full = reshard.read_full(*reshard.resolve_checkpoint(tmp / "run"), with_optimizer=False)
    model = LlamaModel(full.cfg.model, full.vocab_size)
    model.load_state_dict(full.model)
    model.eval()
    tok = BPETokenizer.from_file(str(tmp / "tokenizer.json"))
    out = []
    for q in QUESTIONS:
        ctx = tok.encode(q["question"])
        row = []
        for choice in q["choices"]:
            whole = tok.encode(q["question"] + " " + choice)
            assert whole[:len(ctx)] == ctx  # the split the harness makes: continuation = whole[len(context):]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids[:, :-1]).double(), dim=-1)[0]
            cont = range(len(ctx), len(whole))
            row.append(float(sum(logp[i - 1, whole[i]] for i in cont)))
        out.append(row)
    return out


def _accuracy(logliks: list[list[float]]) -> float:
    return sum(max(range(len(r)), key=r.__getitem__) == q["answer"] for r, q in zip(logliks, QUESTIONS, strict=True)) / len(QUESTIONS)


def test_exported_model_scores_the_task_like_our_model(exported):
    tmp, hf_dir = exported
    ours = _our_logliks(tmp)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for q, want in zip(QUESTIONS, ours, strict=True):
        ctx = tok(q["question"], add_special_tokens=False).input_ids
        for choice, w in zip(q["choices"], want, strict=True):
            whole = tok(q["question"] + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits.double(), dim=-1)[0]
            got = float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))
            assert abs(got - w) <= 1e-4, (q["question"], choice, got, w)


def test_lm_eval_harness_on_the_local_task(exported, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install lm_eval): harness part skipped")
    tmp, hf_dir = exported
    tasks = write_task(tmp / "tasks")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # no hub: the task's data is the local JSONL
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf_dir},dtype=float32", tasks=["tiny_mc"],
                                  task_manager=TaskManager(include_path=str(tasks)), device="cpu", batch_size=1,
                                  log_samples=True)
    ours = _our_logliks(tmp)
    samples = sorted(res["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    for s, want in zip(samples, ours, strict=True):
        got = [float(r[0]) for r in s["filtered_resps"]]
        assert all(abs(g - w) <= 1e-4 for g, w in zip(got, want, strict=True)), (got, want)
    assert res["results"]["tiny_mc"]["acc,none"] == pytest.approx(_accuracy(ours), abs=0)
