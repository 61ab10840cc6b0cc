"""Atomic checkpoints: ``<run_dir>/checkpoints/step_<N:06d>/`` holding one shard file per
(TP, PP) rank and a ``meta.json``.

A checkpoint is first written to ``.tmp_step_<N>/`` and renamed into place only when
complete, so a crash mid-save leaves the previous checkpoint intact and never a
half-written one that ``latest_checkpoint`` could pick up. Under data parallelism
only DP rank 0 of each (TP, PP) shard writes; the caller runs a barrier between
``write_shard`` and ``commit`` (see training/trainer.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_snip.atomic_io import atomic_write_text

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def shard_name(tp_rank: int = 0, pp_rank: int = 0) -> str:
    return f"shard_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def step_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"step_{step:06d}"


def tmp_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f".tmp_step_{step:06d}"


def write_shard(ckpt_root: Path, step: int, state: dict[str, Any], tp_rank: int = 0, pp_rank: int = 0) -> None:
    """Write this rank's shard into the temporary directory of checkpoint ``step``."""
    d = tmp_dir(ckpt_root, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / shard_name(tp_rank, pp_rank)
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def commit(ckpt_root: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Make checkpoint ``step`` visible (rename its temp dir) and prune old ones (rank 0 only)."""
    d_tmp, d_final = tmp_dir(ckpt_root, step), step_dir(ckpt_root, step)
    atomic_write_text(d_tmp / "meta.json", json.dumps(meta, indent=1))
    if d_final.exists():  # re-saving the same step (e.g. after a resume): replace it
        shutil.rmtree(d_final)
    os.replace(d_tmp, d_final)
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(step_dir(ckpt_root, old), ignore_errors=True)
    return d_final


def list_checkpoints(ckpt_root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``ckpt_root``, ascending."""
    if not ckpt_root.is_dir():
        return []
    steps = []
    for p in ckpt_root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "meta.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(ckpt_root: Path) -> int | None:
    steps = list_checkpoints(ckpt_root)
    return steps[-1] if steps else None


def read_meta(ckpt_root: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(ckpt_root, step) / "meta.json").read_text())


def read_shard(ckpt_root: Path, step: int, tp_rank: int = 0, pp_rank: int = 0) -> dict[str, Any]:
    path = step_dir(ckpt_root, step) / shard_name(tp_rank, pp_rank)
    if not path.is_file():
        raise ValueError(f"checkpoint {step_dir(ckpt_root, step)} has no shard {path.name}; it was saved with another "
                         f"TP/PP layout (see its meta.json) - resume with the same parallel.tp/parallel.pp")
    return torch.load(path, map_location="cpu", weights_only=False)
