"""Atomic, verified checkpoints: ``<run_dir>/checkpoints/step_<N:06d>/`` holding one shard file
per (TP, PP) rank and a ``meta.json`` that records each shard's sha256.

A checkpoint is first written to ``.tmp_step_<N>/`` and renamed into place only when
complete, so a crash mid-save leaves the previous checkpoint intact and never a
half-written one that ``latest_checkpoint`` could pick up. Each shard is fsynced before
its rename and its sha256 is written next to it (``<shard>.sha256``); ``commit`` gathers
those into ``meta.json["shards"]``. Under data parallelism only DP rank 0 of each (TP, PP)
shard writes; the caller runs a barrier between ``write_shard`` and ``commit`` (see
training/trainer.py).

Loading is safe against hostile files: shards are read with ``torch.load(weights_only=True)``
(tensors, numbers, strings, lists and dicts only - a pickled ``__reduce__`` payload is
refused, never run) and only after their checksum matched (``verify``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_snip.atomic_io import atomic_write_text, file_sha256, fsync_dir

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_SHARD = re.compile(r"^shard_tp(\d{2})_pp(\d{2})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, incomplete, unreadable); the message says which and why."""


def shard_name(tp_rank: int = 0, pp_rank: int = 0) -> str:
    return f"shard_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def step_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"step_{step:06d}"


def tmp_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f".tmp_step_{step:06d}"


def write_shard(ckpt_root: Path, step: int, state: dict[str, Any], tp_rank: int = 0, pp_rank: int = 0,
                on_partial: Callable[[], None] | None = None) -> str:
    """Write this rank's shard into the temporary directory of checkpoint ``step``; returns its sha256.

    The file is fsynced before the rename, and its checksum lands next to it for ``commit``.
    ``on_partial`` runs once the ``.partial`` file is written, before its rename (a test hook: the
    asynchronous writer pauses or fails there, training/async_checkpoint.py)."""
    d = tmp_dir(ckpt_root, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / shard_name(tp_rank, pp_rank)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if on_partial is not None:
        on_partial()
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    atomic_write_text(path.with_name(path.name + ".sha256"), digest + "\n")
    return digest


def commit(ckpt_root: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Make checkpoint ``step`` visible (rename its temp dir) and prune old ones (rank 0 only).

    ``meta`` gains ``"shards": {file name: sha256}`` from the shards in the temp dir. Pruning
    keeps the ``keep`` newest checkpoints up to ``step`` and never touches a newer one."""
    d_tmp, d_final = tmp_dir(ckpt_root, step), step_dir(ckpt_root, step)
    shards = {}
    for p in sorted(d_tmp.glob("shard_*.pt")):
        sidecar = p.with_name(p.name + ".sha256")
        shards[p.name] = sidecar.read_text().strip() if sidecar.is_file() else file_sha256(p)
        sidecar.unlink(missing_ok=True)
    atomic_write_text(d_tmp / "meta.json", json.dumps({**meta, "shards": shards}, indent=1))
    if d_final.exists():  # re-saving the same step (e.g. after a resume): replace it
        shutil.rmtree(d_final)
    os.replace(d_tmp, d_final)
    fsync_dir(ckpt_root)
    older = [s for s in list_checkpoints(ckpt_root) if s <= step]
    for old in older[:-keep]:
        shutil.rmtree(step_dir(ckpt_root, old), ignore_errors=True)
    return d_final


def remove_interrupted_saves(ckpt_root: Path) -> list[str]:
    """Delete the temp directories (``.tmp_step_N``) of saves that never committed - a process
    ended mid-save (the grace deadline, kill -9, a crash) - and return one log line per directory
    (rank 0, at start-up, before this run saves: a stale shard left there would otherwise be
    committed with the next save of step N, even one from another TP/PP layout)."""
    lines = []
    for d in sorted(ckpt_root.glob(".tmp_step_*")) if ckpt_root.is_dir() else []:
        if not d.is_dir():
            continue
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        shutil.rmtree(d, ignore_errors=True)
        lines.append(f"removed {d} ({size / 1e6:.1f} MB): the temporary directory of a save of step "
                     f"{d.name.removeprefix('.tmp_step_').lstrip('0') or '0'} that was interrupted before its commit")
    return lines


def list_checkpoints(ckpt_root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``ckpt_root`` (those with a meta.json), ascending."""
    if not ckpt_root.is_dir():
        return []
    steps = []
    for p in ckpt_root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "meta.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(ckpt_root: Path) -> int | None:
    """The newest committed checkpoint (not verified; see ``latest_verified``)."""
    steps = list_checkpoints(ckpt_root)
    return steps[-1] if steps else None


def read_meta(ckpt_root: Path, step: int) -> dict[str, Any]:
    path = step_dir(ckpt_root, step) / "meta.json"
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable ({type(e).__name__}: {e}); the checkpoint "
                              f"is corrupt - delete {path.parent} or resume from an older checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint metadata {path} holds {type(meta).__name__}, not a JSON object; the "
                              f"checkpoint is corrupt - delete {path.parent}")
    return meta


def verify(ckpt_root: Path, step: int, tp: int | None = None, pp: int | None = None) -> dict[str, Any]:
    """Check that every shard of checkpoint ``step`` listed in its meta.json is there and matches
    its recorded sha256 - and, when ``tp``/``pp`` are given, that it has the shards of that
    layout; returns its meta. Raises ``CheckpointError`` saying why not."""
    d = step_dir(ckpt_root, step)
    meta = read_meta(ckpt_root, step)
    sums = meta.get("shards")
    if not isinstance(sums, dict) or not sums:
        raise CheckpointError(f"checkpoint {d} records no shard checksums (meta.json 'shards'; written by an "
                              f"older version?) so it cannot be verified")
    layout = (tp or 1, pp or 1) if (tp or pp) else (0, 0)
    for tp_rank in range(layout[0]):
        for pp_rank in range(layout[1]):
            name = shard_name(tp_rank, pp_rank)
            if name not in sums:
                raise CheckpointError(f"checkpoint {d} was saved with tp={meta.get('tp')} pp={meta.get('pp')} and has "
                                      f"no {name}; resume with the same parallel.tp/parallel.pp")
    for name, digest in sums.items():
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {d} is incomplete: shard {name} listed in meta.json is missing")
        got = file_sha256(path)
        if got != digest:
            raise CheckpointError(f"checkpoint {d}: shard {name} is corrupt (sha256 {got[:12]}... != recorded "
                                  f"{str(digest)[:12]}..., size {path.stat().st_size} bytes)")
    return meta


def latest_verified(ckpt_root: Path) -> tuple[int | None, list[str]]:
    """The newest checkpoint whose shards ``verify`` (intact, whatever their layout), and one
    reason per newer one it skipped."""
    skipped: list[str] = []
    for step in reversed(list_checkpoints(ckpt_root)):
        try:
            verify(ckpt_root, step)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return step, skipped
    return None, skipped


def set_aside(ckpt_root: Path, step: int) -> Path:
    """Rename a checkpoint that failed verification to ``rejected_step_<N>`` (kept for inspection,
    invisible to ``list_checkpoints`` and to pruning)."""
    d = step_dir(ckpt_root, step)
    target = ckpt_root / f"rejected_{d.name}"
    if target.exists():
        shutil.rmtree(target)
    os.replace(d, target)
    return target


def check_finite(tensors: dict[str, Any], where: str) -> None:
    """Refuse weights holding NaN or Inf, naming the first such tensor: a checkpoint whose
    checksum matches but whose weights are not finite was saved from a diverged run (or written
    wrong), and would only turn every loss into NaN downstream."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{where}: tensor {name} {tuple(t.shape)} holds {bad} non-finite value(s) "
                                  f"(NaN/Inf); the weights are unusable - use an older checkpoint of the run")


def read_shard(ckpt_root: Path, step: int, tp_rank: int = 0, pp_rank: int = 0,
               sha256: str | None = None, *, mmap: bool = False, finite: bool = True) -> dict[str, Any]:
    """Load one shard (``weights_only=True``; checked against ``sha256`` when given). ``mmap``: its
    tensors are memory-mapped, so only the bytes of the tensors used are read. ``finite``: refuse
    non-finite model weights naming the tensor (``check_finite``; off only where a caller checks
    the tensors it keeps, so that a memory-mapped read touches no others)."""
    d = step_dir(ckpt_root, step)
    path = d / shard_name(tp_rank, pp_rank)
    if not path.is_file():
        meta = read_meta(ckpt_root, step) if (d / "meta.json").is_file() else {}
        tp, pp = meta.get("tp", 1), meta.get("pp", 1)
        if tp_rank >= tp or pp_rank >= pp:
            raise CheckpointError(f"checkpoint {d} has no shard {path.name}; it was saved with another TP/PP layout "
                                  f"(tp={tp} pp={pp}) - resume with the same parallel.tp/parallel.pp")
        raise CheckpointError(f"checkpoint {d} is incomplete: shard {path.name} is missing")
    if sha256 is not None and file_sha256(path) != sha256:
        raise CheckpointError(f"checkpoint {d}: shard {path.name} does not match its recorded sha256 (corrupt)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types; all mean "unusable"
        raise CheckpointError(f"checkpoint shard {path} cannot be loaded safely ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); only tensors, numbers, strings, lists "
                              f"and dicts are accepted (weights_only=True)") from None
    if finite and isinstance(state, dict) and isinstance(state.get("model"), dict):
        check_finite(state["model"], f"checkpoint {d}: shard {path.name}")
    return state
