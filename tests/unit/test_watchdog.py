"""parallel/watchdog.py on its own: a silent peer is named, a worker whose launcher died stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_snip.parallel.watchdog import EXIT_HUNG, Heartbeat

REPO = Path(__file__).resolve().parents[2]


def test_a_peer_whose_heartbeat_stops_is_named_with_its_step(tmp_path):
    messages = []
    hb = Heartbeat(tmp_path, rank=0, world_size=2, timeout_s=1.0, interval_s=0.05, on_hang=messages.append)
    (tmp_path / "rank_00001.json").write_text(json.dumps({"beat": 7, "step": 42, "host": "n3", "pid": 99}))
    hb.start()
    deadline = time.monotonic() + 5
    while not messages and time.monotonic() < deadline:
        time.sleep(0.05)
    hb.stop()
    assert messages and messages[0].startswith("error: rank 1 (n3 pid 99) stopped responding at step 42: no heartbeat"), \
        messages
    assert "parallel.collective_timeout_s=1" in messages[0]


def test_a_beating_peer_is_not_hung(tmp_path):
    messages = []
    a = Heartbeat(tmp_path, rank=0, world_size=2, timeout_s=0.6, interval_s=0.05, on_hang=messages.append).start()
    b = Heartbeat(tmp_path, rank=1, world_size=2, timeout_s=0.6, interval_s=0.05, on_hang=messages.append).start()
    time.sleep(1.5)
    a.stop()
    b.stop()
    assert messages == []


CHILD = """
import os, sys, time
os.environ["TORCHELASTIC_RUN_ID"] = "test"
from megatron_snip.parallel.watchdog import Heartbeat
Heartbeat(sys.argv[1], rank=0, world_size=1, timeout_s=2.0, interval_s=0.1).start()
time.sleep(60)
"""

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stderr=open(sys.argv[3], "w"))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_worker_whose_launcher_died_stops(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(tmp_path / "hb"), str(tmp_path / "err")],
                              stdout=subprocess.PIPE, text=True, env=env)
    child_pid = int(parent.stdout.readline())
    time.sleep(1.0)
    parent.send_signal(signal.SIGKILL)  # the "torchrun agent" dies
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Path(f"/proc/{child_pid}").exists() and \
            "Z" not in Path(f"/proc/{child_pid}/stat").read_text().split()[2]:
        time.sleep(0.1)
    alive = Path(f"/proc/{child_pid}").exists() and "Z" not in Path(f"/proc/{child_pid}/stat").read_text().split()[2]
    if alive:
        os.kill(child_pid, signal.SIGKILL)
    assert not alive, "the orphaned worker kept running"
    err = (tmp_path / "err").read_text()
    assert "the torchrun agent (pid" in err and "is gone; stopping this worker" in err, err
    assert EXIT_HUNG == 4
