"""Start a small multi-rank gloo job from a test, bounded in time and cleaned up on failure.

    results = run_ranks(worker, world_size=2, args=(...), timeout_s=90)

``worker(rank, world_size, *args)`` must be a module-level function (it is pickled into
spawned processes). Each child gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT on a free localhost port), one intra-op thread (the test machine
has 2 shared cores), and returns a picklable value; ``run_ranks`` returns them by rank. A
rank that raises makes the whole call fail with that rank's traceback; the other ranks are
terminated (after a grace period), and so is everything when ``timeout_s`` runs out.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY = "launch/configs/tiny.toml"
# A 2-layer d=64 model on tiny.toml with 2 x 4 micro-batches a step: what the multi-rank
# training tests (HF import, resume at a new layout, preemption) train.
SMALL_MULTI_RANK = [
    "precision.compile_quantizers=false", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64",
    "model.num_attention_heads=4", "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=2",
    "training.global_batch_size=8", "training.warmup_steps=1", "training.eval_batches=1",
    "training.eval_interval=1000", "training.log_interval=1", "training.progress=false", "snip.enabled=false",
    "data.valid_paths=[]",
]

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        result = fn(rank, world_size, *args)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except Exception:  # noqa: BLE001 - any failure is reported to the parent with its traceback
        (out / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        from megatron_snip.parallel.distributed import destroy_distributed

        destroy_distributed()


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0,
              grace_s: float = 10.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; results by rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dist_test_") as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, out_dir, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        timed_out = False
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now  # let the others notice / finish, then stop them
                if failed_at is not None and now > failed_at + grace_s:
                    break
                if now > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        errors = {r: (Path(out_dir) / f"{r}.err").read_text() for r in range(world_size)
                  if (Path(out_dir) / f"{r}.err").is_file()}
        if errors:
            first = min(errors)
            raise AssertionError(f"rank {first} of {world_size} failed ({len(errors)} rank(s) raised):\n{errors[first]}")
        if timed_out:
            raise AssertionError(f"distributed test timed out after {timeout_s:.0f} s "
                                 f"(exit codes {[p.exitcode for p in procs]})")
        missing = [r for r in range(world_size) if not (Path(out_dir) / f"{r}.pkl").is_file()]
        if missing:
            raise AssertionError(f"ranks {missing} exited without a result (exit codes {[p.exitcode for p in procs]})")
        return [pickle.loads((Path(out_dir) / f"{r}.pkl").read_bytes()) for r in range(world_size)]
