"""Issue #36 item 3: a grace period never costs a checkpoint that could be written safely.

A stop at a step boundary comes before that boundary's evaluation (skipped when the stop was
already requested, aborted between two evaluation batches when it arrives during it); a forced
stop says what was really lost (inside a step, at a boundary, during a save); an interrupted
save's temp directory is removed at the next start, with a log line; steps are counted as the
log counts them. The child-process cases run ``python -m megatron_snip.train`` for real, the
evaluation or the save slowed down by a patch, with ``training.preempt_grace_s`` shorter than it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import SMALL

from megatron_snip import train as train_cli
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.preemption import EXIT_PREEMPTED
from megatron_snip.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = "launch/configs/tiny.toml"

# Every evaluation batch takes EVAL_BATCH_S; at the first evaluation the process signals itself
# (as a scheduler would) during the first batch. Two validation sets x 2 batches: ~4 x EVAL_BATCH_S.
SLOW_EVAL_RUN = """
import os, signal, sys, time
from megatron_snip import train
from megatron_snip.training.trainer import Trainer
real, seconds, sent = Trainer.evaluate_batch, float(os.environ["EVAL_BATCH_S"]), []
def slow(self, tokens):
    if not sent:
        sent.append(1)
        print("evaluation started", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(seconds)
    return real(self, tokens)
Trainer.evaluate_batch = slow
sys.exit(train.main(sys.argv[1:]))
"""

# The save of step 4 writes its shard, then hangs before the commit (a large, slow save).
SLOW_SAVE_RUN = """
import sys, time
from megatron_snip import train
from megatron_snip.training import checkpoint as ckpt
real = ckpt.write_shard
def slow(root, step, state, *a, **k):
    out = real(root, step, state, *a, **k)
    if step == 4:
        print("saving", flush=True)
        time.sleep(60)
    return out
ckpt.write_shard = slow
sys.exit(train.main(sys.argv[1:]))
"""


def _run_child(code: str, overrides: list[str], env: dict[str, str] | None = None,
               signal_on: str | None = None, timeout_s: float = 240) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds from ``signal_on``'s line (or start) to exit); sends SIGTERM
    when the child prints ``signal_on``."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [sys.executable, "-c", code, "--config", TINY, *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out_lines, mark = [], time.monotonic()
    if signal_on is not None:
        for line in proc.stdout:
            out_lines.append(line)
            if signal_on in line:
                mark = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                break
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the child did not end") from None
    return proc.returncode, "".join(out_lines) + out, err, time.monotonic() - mark


def _over(tmp_path: Path, *extra: str) -> list[str]:
    return SMALL + [f"training.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
                    "data.valid_paths=[\"bundled:moby_dick\"]", *extra]


def test_a_stop_during_an_evaluation_longer_than_the_grace_still_writes_the_checkpoint(tmp_path):
    # without the abort: ~4 x 3 s of evaluation > the 5 s grace, the watcher ends the run unsaved (exit 143)
    code, out, err, _ = _run_child(SLOW_EVAL_RUN, _over(tmp_path, "training.max_steps=8", "training.eval_interval=2",
                                                       "training.preempt_grace_s=5"), env={"EVAL_BATCH_S": "3"})
    assert code == EXIT_PREEMPTED, (code, err)
    assert ("preempted: received SIGTERM; stopped after step 2: checkpoint "
            f"{tmp_path / 'run' / 'checkpoints' / 'step_000002'} written; its evaluation was aborted (the signal came "
            "during it) to save first") in out, out
    assert "stopped at once" not in err and "between step boundaries" not in err, err
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [2]
    ckpt.verify(tmp_path / "run" / "checkpoints", 2)


def test_a_forced_stop_during_a_boundarys_evaluation_says_so_not_between_step_boundaries(tmp_path):
    # one evaluation batch (20 s) outlasts the 2 s grace: the watcher must end it, and say where it was
    code, out, err, _ = _run_child(SLOW_EVAL_RUN, _over(tmp_path, "training.max_steps=8", "training.eval_interval=2",
                                                       "training.preempt_grace_s=2"), env={"EVAL_BATCH_S": "20"})
    assert code == 128 + signal.SIGTERM, (code, out, err)
    assert ("No checkpoint was written for step 2: the run was at the step boundary after it (its evaluation) and "
            "the checkpoint was to come next") in err, err
    assert "between step boundaries" not in err, err


def test_a_stop_requested_before_an_evaluation_skips_it_and_saves(tmp_path, monkeypatch, capsys):
    real = Trainer.train_step

    def step_then_signal(self, step):
        res = real(self, step)
        if step == 1:  # during step 2, whose boundary evaluates
            os.kill(os.getpid(), signal.SIGTERM)
        return res

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    over = _over(tmp_path, "training.max_steps=8", "training.eval_interval=2", "training.log_interval=1")
    assert train_cli.main(["--config", TINY, *[a for o in over for a in ("--set", o)]]) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    assert ("stopped after step 2: checkpoint " f"{tmp_path / 'run' / 'checkpoints' / 'step_000002'} written; its "
            "evaluation was skipped to save first") in out, out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "val_loss" in r], rows  # the evaluation did not run
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [2]


def test_an_interrupted_save_says_so_and_its_temp_dir_is_removed_at_the_next_start(tmp_path, capsys):
    over = _over(tmp_path, "training.max_steps=6", "training.save_interval=2", "training.eval_interval=100",
                 "training.preempt_grace_s=1")
    code, _, err, after = _run_child(SLOW_SAVE_RUN, over, signal_on="saving")
    assert code == 128 + signal.SIGTERM and after < 30, (code, after, err)
    assert ("The checkpoint of step 4 was being written and is not committed (a save is committed only once complete; "
            "its temporary directory is removed at the next start)") in err, err
    assert "between step boundaries" not in err, err
    root = tmp_path / "run" / "checkpoints"
    assert ckpt.list_checkpoints(root) == [2] and ckpt.tmp_dir(root, 4).is_dir()
    assert train_cli.main(["--config", TINY, *[a for o in over + ["training.resume=auto"] for a in ("--set", o)]]) == 0
    log = capsys.readouterr().out
    assert f"removed {ckpt.tmp_dir(root, 4)} (" in log and (
        "MB): the temporary directory of a save of step 4 that was interrupted before its commit") in log, log
    assert "resumed from step 2" in log
    assert not list(root.glob(".tmp_step_*")) and ckpt.list_checkpoints(root) == [4, 6]
