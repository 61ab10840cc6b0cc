"""A second stop signal, or the grace deadline, ends a run at once (issue #26, section 2).

The first SIGTERM/SIGUSR1/SIGINT asks for a checkpoint at the next step boundary (tested in
test_operations.py); here the boundary never comes (a long step), and the process must end
within seconds of the second signal or of ``training.preempt_grace_s``, saying that no checkpoint
was written and which committed one a resume continues from. Each case runs in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import SMALL

from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.preemption import StopSignal

ROOT = Path(__file__).resolve().parents[2]

LONG_C_CALLS = """
import sys, time, torch
from megatron_snip.training.preemption import StopSignal
with StopSignal(grace_s=float(sys.argv[1]), last_checkpoint=lambda: "NEWEST-CHECKPOINT"):
    print("ready", flush=True)
    a, t0 = torch.randn(300, 300), time.time()
    while time.time() - t0 < 60:  # a long step: C calls, no step boundary
        a = (a @ a).tanh()
print("left normally", flush=True)
"""

LONG_STEP_RUN = """
import sys, time
from megatron_snip import train
from megatron_snip.training.trainer import Trainer
real = Trainer.train_step
def slow(self, step):
    out = real(self, step)
    if step == 2:  # step_000002 is committed; the step after it never ends
        print("long step", flush=True)
        time.sleep(60)
    return out
Trainer.train_step = slow
sys.exit(train.main(sys.argv[1:]))
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(proc: subprocess.Popen, line: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = proc.stdout.readline()
        if line in out:
            return
        if not out and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {line!r}: {proc.stderr.read()}")
    proc.kill()
    raise AssertionError(f"no {line!r} within {timeout_s} s")


def _ended_within(proc: subprocess.Popen, seconds: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running {seconds} s after the signal that should end it at once") from None
    return proc.returncode, err


def test_second_signal_ends_a_long_c_call_at_once():
    proc = _start(LONG_C_CALLS, "0")
    _wait_for(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    code, err = _ended_within(proc, 15)
    assert code == 128 + signal.SIGTERM, (code, err)
    assert "stopped at once: a second stop signal (SIGTERM, after SIGTERM)" in err and "NEWEST-CHECKPOINT" in err, err
    assert "No checkpoint was written for the work since the last one" in err, err


def test_grace_deadline_ends_the_process_after_one_signal():
    proc = _start(LONG_C_CALLS, "1.5")
    _wait_for(proc, "ready")
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, err = _ended_within(proc, 15)
    assert code == 128 + signal.SIGINT and time.monotonic() - sent >= 1.5, (code, err)
    assert "training.preempt_grace_s=1.5 s passed after SIGINT before the run stopped at a step boundary" in err, err


def test_second_sigterm_during_a_long_training_step_names_the_checkpoint_resume_uses(tmp_path):
    run = tmp_path / "run"
    over = SMALL + [f"training.run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "training.max_steps=10",
                    "training.save_interval=2", "training.preempt_grace_s=0"]
    proc = _start(LONG_STEP_RUN, "--config", "launch/configs/tiny.toml", *[a for o in over for a in ("--set", o)])
    _wait_for(proc, "long step")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    code, err = _ended_within(proc, 20)
    assert code == 128 + signal.SIGTERM, (code, err)
    assert "stopped at once: a second stop signal (SIGTERM, after SIGTERM)" in err, err
    assert f"The newest committed checkpoint is step 2 ({run / 'checkpoints' / 'step_000002'})" in err, err
    assert ckpt.list_checkpoints(run / "checkpoints") == [2]
    ckpt.verify(run / "checkpoints", 2)  # intact: nothing was lost that had been committed


def test_the_stop_flag_a_step_reduces_follows_the_signal():
    with StopSignal() as stop:
        assert float(stop.flag_on(torch.device("cpu"))) == 0.0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1
        assert float(stop.flag_on(torch.device("cpu"))) == 1.0


def test_the_watcher_sets_the_stop_flag_while_the_main_thread_is_in_a_c_call():
    """CPython's C-level handler writes the signal number to the wakeup fd at once; the Python
    handler (``received``) waits until the main thread is back in the interpreter - on a GPU run
    it may sit in a CUDA event wait. The watcher thread sets the pinned flag a step's copy reads
    from that byte alone (written here directly, as the C handler does)."""
    with StopSignal() as stop:
        stop._pair[1].send(bytes([signal.SIGTERM]))
        deadline = time.monotonic() + 30
        while not float(stop._flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.received is None  # no Python handler ran: the flag came from the watcher
        assert float(stop.flag_on(torch.device("cpu"))) == 1.0


def test_the_watcher_has_ended_when_the_context_exits():
    """The watcher thread is joined on exit, not left to end on its own: a daemon thread still
    running when the interpreter finalizes is killed by pthread_exit, which aborted finished runs
    (exit 134, "terminate called without an active exception"), 2 of 180 exits here. Right after
    __exit__ the old watcher was usually still alive (it needs the GIL the main thread holds)."""
    import threading

    for _ in range(20):
        with StopSignal():
            pass
        assert not [t for t in threading.enumerate() if t.name == "stop-signal-watcher"]

