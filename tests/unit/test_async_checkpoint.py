"""``training.async_save`` (issue #36 item 4): checkpoints written by a background thread.

The claims, each tested here: an async run equals a synchronous one bitwise (losses and the
checkpointed tensors); a kill -9 at any point of the background write (snapshot taken, shard
half-written, shard written but not committed) leaves the previous checkpoint the newest committed
one, and ``resume=auto`` from it equals an uninterrupted run bitwise - as the synchronous save is
tested in test_operations.py; at most one save is in flight while training runs on; a writer's
error stops the run naming the checkpoint; a preemption waits for the write in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from megatron_snip import train as train_cli
from megatron_snip.config import load_config
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.async_checkpoint import HOOK_ENV, HostBuffers, hook_from_env
from megatron_snip.training.preemption import EXIT_PREEMPTED
from megatron_snip.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = "launch/configs/tiny.toml"
COMMON = ["training.max_steps=8", "training.save_interval=2", "training.log_interval=1", "training.eval_interval=100",
          "precision.initial_plan=uniform:nvfp4"]


def _argv(overrides):
    return ["--config", TINY, *[a for o in overrides for a in ("--set", o)]]


def _in(small_overrides, run_dir):
    return [o for o in small_overrides if not o.startswith("training.run_dir")] + [f"training.run_dir={run_dir}"]


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _final_model(run_dir, step=8):
    return ckpt.read_shard(run_dir / "checkpoints", step)["model"]


def _same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def reference(small_overrides, tmp_path):
    """An uninterrupted synchronous run of COMMON: its run directory."""
    ref = tmp_path / "ref"
    assert train_cli.main(_argv(_in(small_overrides, ref) + COMMON)) == 0
    return ref


def test_async_run_equals_the_synchronous_run_bitwise(small_overrides, tmp_path, reference, capsys):
    run = tmp_path / "run"
    assert train_cli.main(_argv(_in(small_overrides, run) + COMMON + ["training.async_save=true"])) == 0
    out = capsys.readouterr().out
    assert "checkpoint " + str(run / "checkpoints" / "step_000002") + " committed (async" in out, out
    assert _losses(run) == _losses(reference)
    assert ckpt.list_checkpoints(run / "checkpoints") == [6, 8]  # keep_checkpoints=2 pruned 2 and 4
    for step in (6, 8):
        ckpt.verify(run / "checkpoints", step)  # sha256 recorded and matching, as a synchronous save
        a, b = ckpt.read_shard(run / "checkpoints", step), ckpt.read_shard(reference / "checkpoints", step)
        assert _same_tensors(a["model"], b["model"])
        assert torch.equal(a["rng_cpu"], b["rng_cpu"]) and a["plan"] == b["plan"] and a["step"] == b["step"] == step
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys() and all(_same_tensors(sa[k], sb[k]) for k in sa)


def _start_paused(overrides, hook):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", HOOK_ENV: hook}
    return subprocess.Popen([sys.executable, "-m", "megatron_snip.train", *_argv(overrides)], cwd=REPO, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _wait_for_line(proc, text, timeout_s=300):
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {text!r}:\n{''.join(seen)}")
    proc.kill()
    raise AssertionError(f"no {text!r} within {timeout_s} s:\n{''.join(seen)}")


@pytest.mark.parametrize("point, left_in_tmp", [
    ("start", set()),  # the snapshot is taken, nothing written yet
    ("partial", {"shard_tp00_pp00.pt.partial"}),  # the shard half-way: written and fsynced, not renamed
    ("written", {"shard_tp00_pp00.pt", "shard_tp00_pp00.pt.sha256"}),  # shard complete, commit not yet agreed
])
def test_kill_9_during_the_background_write_resumes_bitwise_from_the_last_commit(
        small_overrides, tmp_path, reference, point, left_in_tmp, capsys):
    run = tmp_path / "run"
    over = _in(small_overrides, run) + COMMON + ["training.async_save=true", "training.resume=auto"]
    proc = _start_paused(over, f"{point}:pause:4")
    try:
        _wait_for_line(proc, f"async-save hook: paused at {point} of step 4")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    root = run / "checkpoints"
    assert ckpt.list_checkpoints(root) == [2], "only the checkpoint committed before the kill is visible"
    ckpt.verify(root, 2)
    tmp = ckpt.tmp_dir(root, 4)
    assert {p.name for p in tmp.iterdir()} == left_in_tmp if tmp.exists() else not left_in_tmp
    capsys.readouterr()
    assert train_cli.main(_argv(over)) == 0  # resume=auto, same config, synchronous or not: async here too
    assert "resumed from step 2" in capsys.readouterr().out
    assert _losses(run) == _losses(reference)
    assert _same_tensors(_final_model(run), _final_model(reference))


def test_at_most_one_save_in_flight_while_training_runs_on(small_overrides, tmp_path):
    cfg = load_config(TINY, _in(small_overrides, tmp_path / "run") + COMMON + [
        "training.save_interval=1", "training.max_steps=6", "training.async_save=true"])
    trainer = Trainer(cfg)
    events: list[tuple[str, int, int, float]] = []  # (what, checkpoint step, trainer step, time)
    lock = threading.Lock()

    def slow_writer(point, step):
        with lock:
            events.append((point, step, trainer.step, time.perf_counter()))
        if point == "start":
            time.sleep(0.3)  # longer than a step of this model: the next save finds this one in flight

    real_commit = trainer.run_directory.commit

    def commit(step, meta):
        with lock:
            events.append(("commit", step, trainer.step, time.perf_counter()))
        real_commit(step, meta)

    trainer.saver.hook = slow_writer
    trainer.run_directory.commit = commit
    trainer.fit()
    trainer.logger.close()
    order = [(what, step) for what, step, _, _ in events if what in ("start", "commit")]
    # saves 1-5 in the background (6 is the final, synchronous one): each committed before the next starts
    assert order == [(w, s) for s in range(1, 6) for w in ("start", "commit")] + [("commit", 6)], order
    commits = {step: at for what, step, at, _ in events if what == "commit"}
    assert all(commits[s] > s for s in range(1, 6)), f"training ran on during every write: {commits}"
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [5, 6]
    # Written while training ran on for 0.3 s, step 5's checkpoint still holds step 5's state (the snapshot):
    # the same tensors as a synchronous run's.
    sync = load_config(TINY, _in(small_overrides, tmp_path / "sync") + COMMON + [
        "training.save_interval=1", "training.max_steps=6"])
    Trainer(sync).fit()
    a, b = (ckpt.read_shard(tmp_path / d / "checkpoints", 5) for d in ("run", "sync"))
    assert _same_tensors(a["model"], b["model"]) and torch.equal(a["rng_cpu"], b["rng_cpu"])


def test_a_writer_error_stops_the_run_naming_the_checkpoint(small_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv(HOOK_ENV, "partial:fail:4")
    cfg = load_config(TINY, _in(small_overrides, tmp_path / "run") + COMMON + ["training.async_save=true"])
    trainer = Trainer(cfg)
    with pytest.raises(ckpt.CheckpointError) as e:
        trainer.fit()
    trainer.logger.close()
    msg = str(e.value)
    root = tmp_path / "run" / "checkpoints"
    assert f"async checkpoint of step 4 ({ckpt.tmp_dir(root, 4)}) failed on rank 0: OSError: " in msg, msg
    assert "failed the writer at partial of step 4" in msg and "was not committed" in msg, msg
    assert ckpt.list_checkpoints(root) == [2]
    assert trainer.step == 5, "one process checks its writer after every step: the error surfaces at once"


def test_a_preemption_waits_for_the_save_in_flight(small_overrides, tmp_path, monkeypatch, capsys):
    real = Trainer.train_step
    writing = threading.Event()

    def step_then_signal(self, step):
        res = real(self, step)
        if step == 2:  # step 3 (0-based 2) ends while step 2's checkpoint is still being written
            assert writing.wait(30)
            os.kill(os.getpid(), signal.SIGTERM)
        return res

    def slow(point, step):
        if point == "written" and step == 2:
            writing.set()
            time.sleep(1.0)

    real_init = Trainer.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.saver.hook = slow

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(Trainer, "__init__", init)
    run = tmp_path / "run"
    assert train_cli.main(_argv(_in(small_overrides, run) + COMMON + ["training.async_save=true"])) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    assert "checkpoint " + str(run / "checkpoints" / "step_000002") + " committed (async" in out, out
    assert ckpt.list_checkpoints(run / "checkpoints") == [2, 3]  # the write in flight, then the preemption's
    for step in (2, 3):
        ckpt.verify(run / "checkpoints", step)


def test_host_buffers_are_a_snapshot_and_are_reused():
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "step": 7, "nested": [torch.arange(4), ("x", torch.ones(2))]}
    buffers = HostBuffers(pin=False)
    first = buffers.copy(state)
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the snapshot must not follow
    assert not torch.equal(first["model"]["weight"], model.weight)
    assert isinstance(first["model"], OrderedDict) and first["model"]._metadata == state["model"]._metadata
    second = buffers.copy(state)
    assert torch.equal(second["model"]["weight"], model.weight) and second["step"] == 7
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr(), "buffers reused"
    assert second["nested"][1][0] == "x" and torch.equal(second["nested"][0], torch.arange(4))


@pytest.mark.parametrize("spec", ["partial", "middle:pause", "partial:stop", "partial:pause:x"])
def test_a_bad_hook_variable_is_refused_naming_it(spec):
    with pytest.raises(ValueError, match=rf"\${HOOK_ENV}={spec!r} is not <point>:<action>"):
        hook_from_env({HOOK_ENV: spec})
    assert hook_from_env({}) is None


def test_the_dry_runs_checkpoint_bytes_are_the_tensors_a_shard_holds(small_overrides, tmp_path, monkeypatch):
    from megatron_snip.sizing import estimate
    from megatron_snip.sizing.checkpoint_time import CKPT_WRITE_ENV, checkpoint_lines, shard_bytes

    cfg = load_config(TINY, small_overrides + ["training.max_steps=1"])
    trainer = Trainer(cfg)
    trainer.fit()
    trainer.logger.close()
    state = ckpt.read_shard(tmp_path / "run" / "checkpoints", 1)
    moments = [t for st in state["optimizer"]["state"].values() for k, t in st.items() if k != "step"]
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*state["model"].values(), *moments])
    sizing = estimate(cfg, 1)
    assert shard_bytes(sizing) == tensor_bytes  # fp32 weights + AdamW m, v: 12 B per parameter, exactly
    monkeypatch.setenv(CKPT_WRITE_ENV, "2")
    assert f"at 2 GB/s per writer (${CKPT_WRITE_ENV})" in checkpoint_lines(sizing)[0]
    monkeypatch.setenv(CKPT_WRITE_ENV, "fast")
    with pytest.raises(ValueError, match=rf"\${CKPT_WRITE_ENV}='fast' is not a bandwidth"):
        checkpoint_lines(sizing)
