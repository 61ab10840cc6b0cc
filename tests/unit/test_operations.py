"""Operating a run: Megatron-style log lines, preemption (SIGTERM) + resume=auto (issue #17, items 13-14)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from megatron_snip import train as train_cli
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.preemption import EXIT_PREEMPTED
from megatron_snip.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = "launch/configs/tiny.toml"
LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] step +(\d+)/(\d+) \| loss \d+\.\d{4} \| lr \d\.\d{3}e-\d\d "
                  r"\| grad norm \d+\.\d{3} \| [\d,]+ tok/s \| \d+\.\d\d TFLOP/s/rank \| peak mem \d+\.\d\d GiB RSS "
                  r"\| skipped 0 \| FP4 share 0\.00 \| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$")


def _argv(overrides):
    return ["--config", TINY, *[a for o in overrides for a in ("--set", o)]]


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_log_lines_without_a_progress_bar(small_overrides, capsys):
    assert train_cli.main(_argv(small_overrides + ["training.max_steps=7", "training.log_interval=3"])) == 0
    out = capsys.readouterr().out
    steps = [int(m.group(1)) for m in map(LINE.match, out.splitlines()) if m]
    assert steps == [3, 6, 7], out  # every log_interval, and the last step


def test_log_lines_with_stdout_in_a_file_and_no_bar(small_overrides, tmp_path):
    over = [o for o in small_overrides if o != "training.progress=false"] + ["training.max_steps=4",
                                                                            "training.log_interval=2"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        res = subprocess.run([sys.executable, "-m", "megatron_snip.train", *_argv(over)], cwd=REPO, stdout=out,
                             stderr=err, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300, check=False)
    text, errors = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert res.returncode == 0, errors
    assert [int(m.group(1)) for m in map(LINE.match, text.splitlines()) if m] == [2, 4], text
    assert "\r" not in text + errors, "a progress bar wrote carriage returns into a file"


def test_sigterm_checkpoints_and_resume_auto_continues_bit_exactly(small_overrides, tmp_path, monkeypatch, capsys):
    common = ["training.max_steps=8", "training.log_interval=1", "training.eval_interval=100",
              "precision.initial_plan=uniform:nvfp4"]
    ref_over = [o for o in small_overrides if not o.startswith("training.run_dir")] + \
        [f"training.run_dir={tmp_path / 'ref'}"]
    assert train_cli.main(_argv(ref_over + common)) == 0
    real = Trainer.train_step

    def step_then_signal(self, step):
        res = real(self, step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-run, between two steps' work
        return res

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    capsys.readouterr()
    assert train_cli.main(_argv(small_overrides + common + ["training.resume=auto"])) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    assert "preempted: received SIGTERM; stopped after step 4: checkpoint" in out and "step_000004" in out, out
    assert ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints") == 4
    monkeypatch.setattr(Trainer, "train_step", real)
    assert train_cli.main(_argv(small_overrides + common + ["training.resume=auto"])) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")


def test_resume_auto_starts_fresh_on_an_empty_directory(small_overrides, tmp_path, capsys):
    assert train_cli.main(_argv(small_overrides + ["training.max_steps=2", "training.resume=auto"])) == 0
    out = capsys.readouterr().out
    assert "training.resume='auto': no checkpoint in" in out and "starting from scratch" in out
    assert ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints") == 2
