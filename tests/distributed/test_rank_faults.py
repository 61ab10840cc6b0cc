"""A rank that stops (SIGSTOP) or dies mid-run ends the whole job within
``parallel.collective_timeout_s``, with a message naming the rank and the step (gloo, 2 ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL
from tests.distributed.dist_harness import free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 16  # parallel.collective_timeout_s: a silent rank is declared hung after 8 s


def _start(mode, tmp_path, fault_step=3):
    port = free_port()
    overrides = SMALL + [f"training.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
                         "training.max_steps=200", "training.eval_interval=1000", "training.device=cpu",
                         "training.micro_batch_size=2",
                         f"parallel.collective_timeout_s={TIMEOUT_S}"]
    argv = ["--config", "launch/configs/tiny.toml", *[a for o in overrides for a in ("--set", o)]]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        with open(tmp_path / f"rank{rank}.err", "w") as err:  # the child keeps its own copy of the fd
            procs.append(subprocess.Popen([sys.executable, str(REPO / "tests/distributed/fault_worker.py"), mode,
                                           str(fault_step), str(tmp_path / "fault_time"), "--", *argv],
                                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs


def _wait_for(procs, tmp_path, deadline_s):
    try:
        procs[0].wait(timeout=deadline_s)
    finally:
        ended = time.time()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    return ended


@pytest.mark.parametrize("mode", ["stop", "die"])
def test_a_stopped_or_dead_rank_ends_the_job_naming_it(tmp_path, mode):
    procs = _start(mode, tmp_path)
    ended = _wait_for(procs, tmp_path, deadline_s=240)
    err0 = (tmp_path / "rank0.err").read_text()
    assert (tmp_path / "fault_time").is_file(), err0 + (tmp_path / "rank1.err").read_text()
    waited = ended - float((tmp_path / "fault_time").read_text())
    assert procs[0].returncode == 4, (procs[0].returncode, err0)
    assert waited < TIMEOUT_S, f"rank 0 needed {waited:.1f} s to give up (collective timeout {TIMEOUT_S} s)"
    # A dead rank resets rank 0's connection at once; rank 0 then waits for the heartbeat to say who.
    assert "error: rank 1 (" in err0 and "stopped responding at step 3" in err0, err0
    assert f"parallel.collective_timeout_s={TIMEOUT_S}" in err0
    assert "Traceback" not in err0, err0
