"""Running the comparison: one training subprocess per run, ``jobs`` at a time, each record
appended to the store as its run finishes."""

from __future__ import annotations

import concurrent.futures
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.comparison.protocol import (
    BASE_POLICY,
    REPO,
    Protocol,
    RunSpec,
    base_run,
    config_path,
    resolved_config,
    run_overrides,
)
from experiments.comparison.store import append_record, is_done, latest_records, read_results
from megatron_snip.telemetry.run_reader import load_run


def parse_run_dir(run_dir: Path) -> dict:
    """Final validation losses, FP4 shares and timings from a finished run's ``metrics.jsonl``
    (read by ``telemetry.run_reader.load_run``, as ``scripts/plot_run.py`` reads it).

    train_s sums the per-step ``step_time_s`` (logged every step with ``log_interval=1``);
    replan_s sums the controller's ``replan_replan_total_s`` (statistics + metrics + solve + apply).
    """
    series = load_run(run_dir).series

    def values(key: str) -> list[float]:
        return series.get(key, ([], []))[1]

    final = {}
    for key in series:  # the latest finite evaluation (at the last step when the run finished)
        finite = [v for v in values(key) if math.isfinite(v)]
        if key.startswith("val_loss") and finite:
            final[key] = finite[-1]
    shares, replan = values("fp4_share"), values("replan_replan_total_s")
    out = {"final": final, "last_step": max((steps[-1] for steps, _ in series.values() if steps), default=0),
           "train_s": sum(values("step_time_s")), "replan_s": sum(replan), "replans": len(replan),
           "fp4_share": shares[-1] if shares else None,
           "fp4_share_mean": float(np.mean(shares)) if shares else None,
           "skipped_steps": int(max(values("skipped_steps"), default=0))}
    plans = sorted((run_dir / "plans").glob("step_*[0-9].json")) if (run_dir / "plans").is_dir() else []
    if plans:
        out["final_plan"] = str(plans[-1].relative_to(run_dir))
    return out


def machine() -> dict[str, str]:
    """What decides a run's float arithmetic besides its config: PyTorch's version and the CPU kernels it
    dispatches to (``torch.backends.cpu.get_cpu_capability()``: e.g. AVX2 or AVX512). Runs of one config on
    machines that differ here need not agree bit for bit, and a long base run can end measurably apart."""
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "processor": platform.processor() or platform.machine()}


def train_command(p: Protocol, overrides: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_snip.train", "--config", str(config_path(p))]
    for ov in overrides:
        cmd += ["--set", ov]
    return cmd


def execute(spec: RunSpec, p: Protocol, out_dir: Path, *, threads: int, timeout_s: float,
            keep_checkpoints: bool = False) -> dict:
    """Train ``spec`` in a fresh ``out_dir/<name>`` as a subprocess; returns its results record.

    A base run keeps its checkpoint: the continuations start from it."""
    run_dir = out_dir / spec.name
    steps = p.base_steps if spec.policy == BASE_POLICY else p.steps
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a partial or stale run: start over (the trainer would append to it)
    run_dir.mkdir(parents=True)
    cmd = train_command(p, run_overrides(spec, p, run_dir))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    rec = {"name": spec.name, "policy": spec.policy, "formats": None if spec.formats is None else list(spec.formats),
           "rho": spec.rho, "seed": spec.seed, "group": spec.group, "steps": steps, "threads": threads,
           "config": resolved_config(spec, p), "command": shlex.join(cmd), "run_dir": str(run_dir),
           "machine": machine()}
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        log.write(rec["command"] + "\n\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the trainer and anything it started
            rc = proc.wait()
            status = "timeout"
    rec.update(returncode=rc, wall_s=time.perf_counter() - t0, finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    if (run_dir / "metrics.jsonl").is_file():
        try:
            rec.update(parse_run_dir(run_dir))
        except ValueError as e:  # a corrupt metrics.jsonl: the run counts as failed, the driver goes on
            status, rec["parse_error"] = "failed", str(e)
    if status == "ok" and rec.get("last_step") != steps:
        status = "failed"  # exited 0 without reaching max_steps: not a result
    rec["status"] = status
    if status != "ok":
        rec["log_tail"] = (run_dir / "train.log").read_text(errors="replace")[-2000:]
    if not keep_checkpoints and spec.policy != BASE_POLICY:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~40 MB each for tiny; not needed here
    return rec


def base_ready(seed: int, p: Protocol, out_dir: Path, latest: dict[str, dict]) -> bool:
    """Is the base run of ``seed`` done under this protocol, with its checkpoint on this machine
    (run directories are not kept from one machine to the next; a missing one is trained again)?"""
    spec = base_run(seed)
    return is_done(spec, p, latest) and (out_dir / spec.name / "checkpoints").is_dir()


def run_all(specs: Sequence[RunSpec], p: Protocol, out_dir: Path, *, jobs: int, threads: int, timeout_s: float,
            keep_checkpoints: bool = False, log=print) -> list[dict]:
    """Run every spec not already done (``jobs`` at a time); append each record as it finishes.

    In the continued protocol the base runs the remaining specs need are trained first. A base trained
    again (its checkpoint is not on this machine) that ends at other final losses than its record is
    another base, and ``log`` says so: the continuations recorded from the first one do not pair with
    the new ones."""
    results_path = out_dir / "results.jsonl"
    latest = latest_records(read_results(results_path))
    todo = [s for s in specs if not is_done(s, p, latest)]
    if len(todo) < len(specs):
        log(f"skipping {len(specs) - len(todo)} finished run(s)")
    kw = {"jobs": jobs, "threads": threads, "timeout_s": timeout_s, "keep_checkpoints": keep_checkpoints, "log": log}
    done: list[dict] = []
    if p.continued:
        bases = [base_run(seed) for seed in dict.fromkeys(s.seed for s in todo)
                 if not base_ready(seed, p, out_dir, latest)]
        done = run_all_now(bases, p, out_dir, **kw)
        for rec in done:
            warn_if_another_base(rec, latest.get(rec["name"]), log)
        failed = {r["seed"] for r in done if r["status"] != "ok"}
        if failed:
            log(f"base run(s) of seed(s) {sorted(failed)} failed; their continuations are not run")
            todo = [s for s in todo if s.seed not in failed]
    return done + run_all_now(todo, p, out_dir, **kw)


def warn_if_another_base(new: dict, old: dict | None, log) -> None:
    """Log a warning if a base trained again (``new``) ended at other final losses than its earlier ok
    record (``old``): the continuations recorded from that one started from another base."""
    if old is None or old.get("status") != "ok" or new.get("status") != "ok" or old.get("final") == new.get("final"):
        return
    log(f"warning: {new['name']} trained again ended at {new.get('final')}, not at its record's {old.get('final')} "
        f"(machines: {old.get('machine', 'not recorded')} then {new.get('machine')}); the continuations recorded "
        f"from the earlier one started from another base and do not pair with runs from this one: put new runs "
        f"in a fresh --out-dir, or rerun every arm there")


def run_all_now(todo: Sequence[RunSpec], p: Protocol, out_dir: Path, *, jobs: int, threads: int, timeout_s: float,
                keep_checkpoints: bool, log) -> list[dict]:
    """Run ``todo`` (``jobs`` at a time), appending each record to ``results.jsonl`` as it finishes."""
    results_path = out_dir / "results.jsonl"
    lock = threading.Lock()
    done: list[dict] = []

    def one(spec: RunSpec) -> dict:
        rec = execute(spec, p, out_dir, threads=threads, timeout_s=timeout_s, keep_checkpoints=keep_checkpoints)
        with lock:
            append_record(results_path, rec)
            done.append(rec)
            losses = " ".join(f"{k}={v:.4f}" for k, v in rec.get("final", {}).items())
            log(f"[{len(done)}/{len(todo)}] {spec.name}: {rec['status']} in {rec['wall_s']:.0f}s {losses}")
        return rec

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, todo))
    return done


