"""The one way a checkpoint is chosen and trusted, for every path that reads one: ``training.resume``
(``run_dir.RunDirectory.latest``), ``training.init_from``, ``python -m megatron_snip.evaluate``,
the Hugging Face export (``scripts/convert_hf.py export``) and ``scripts/reshard_checkpoint.py``.

``open_checkpoint(path, field)`` takes what a user names (resume names the run's ``checkpoints/``):
  * one ``checkpoints/step_N`` directory: that checkpoint, verified (every shard's sha256 against
    ``meta.json["shards"]``); a failing shard is refused by name, with the newest checkpoint of
    the run that does verify as the fix;
  * a run directory or its ``checkpoints/``: the newest checkpoint that verifies, falling back
    past the newer ones that do not, as resume does (without setting them aside: a reader only
    reads); ``Opened.note`` says which one it used and why it skipped the others.
Loading then goes through ``checkpoint.read_shard``, which refuses non-finite weights naming the
tensor (``checkpoint.check_finite``).

Cost: verifying reads every byte of the checkpoint once (sha256, ~1 GB/s per core), the price
resume already pays on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_snip.training import checkpoint as ckpt

_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class Opened:
    """A verified checkpoint: its ``checkpoints/`` root, step, meta.json, and one line saying
    which checkpoint was used (and which newer ones were skipped, with their reasons)."""

    root: Path
    step: int
    meta: dict[str, Any]
    note: str
    skipped: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return ckpt.step_dir(self.root, self.step)


def _as_step_dir(p: Path) -> tuple[Path, int] | None:
    if p.name.startswith("step_") and (p / "meta.json").is_file():
        try:
            return p.parent, int(p.name.removeprefix("step_"))
        except ValueError:
            return None
    return None


def _not_found(path: str | Path, field: str) -> ValueError:
    p = Path(path)
    if p.is_dir() and any((p / n).exists() for n in _HF_WEIGHTS) and not (p / "config.json").is_file():
        return ValueError(f"{field}={str(path)!r} looks like a Hugging Face model directory (it has "
                          f"{next(n for n in _HF_WEIGHTS if (p / n).exists())}) but has no config.json; copy the "
                          f"model's config.json next to its weights (from the model's source, or save_pretrained)")
    if not p.exists():
        return ValueError(f"{field}={str(path)!r}: no checkpoint there (the path does not exist); give a run "
                          f"directory or one of its checkpoints/step_N directories")
    return ValueError(f"{field}={str(path)!r}: no checkpoint there (expected a run directory with "
                      f"checkpoints/step_*/meta.json, or one checkpoints/step_N directory); check the path or "
                      f"train a run first")


def open_checkpoint(path: str | Path, field: str = "checkpoint", *, missing_ok: bool = False,
                    none_verify_fix: str = "restore one from a copy") -> Opened | None:
    """Resolve ``path`` (see the module docstring) to a checkpoint whose shards all match their
    recorded sha256. Raises ``CheckpointError`` (a ``ValueError``) naming ``field``, the path, the
    failing shard and the fix (``none_verify_fix`` when no checkpoint of a run verifies);
    ``ValueError`` when there is no checkpoint at all, or None with ``missing_ok`` (resume: a run
    that has not checkpointed yet starts from scratch)."""
    p = Path(path)
    named = _as_step_dir(p)
    if named is not None:
        root, step = named
        try:
            meta = ckpt.verify(root, step)
        except ckpt.CheckpointError as e:
            good, _ = ckpt.latest_verified(root)
            fix = (f"give {ckpt.step_dir(root, good)} (the newest checkpoint of the run that verifies) or the run "
                   f"directory" if good is not None else "no other checkpoint of this run verifies either; restore "
                   "it from a copy")
            raise ckpt.CheckpointError(f"{field}={str(path)!r}: {e}; {fix}") from None
        return Opened(root, step, meta, f"using checkpoint {ckpt.step_dir(root, step)} (step {step}, verified)")
    for root in (p / "checkpoints", p):
        steps = ckpt.list_checkpoints(root)
        if not steps:
            continue
        step, skipped = ckpt.latest_verified(root)
        if step is None:
            raise ckpt.CheckpointError(f"{field}={str(path)!r}: no checkpoint in {root} verifies ({len(steps)} "
                                       f"rejected; the newest: {skipped[0]}); {none_verify_fix}")
        note = f"using checkpoint {ckpt.step_dir(root, step)} (step {step}, the newest that verifies)"
        if skipped:
            note += f"; skipped {len(skipped)} newer: " + " | ".join(skipped)
        return Opened(root, step, ckpt.read_meta(root, step), note, skipped)
    if missing_ok and not p.is_file():
        return None
    raise _not_found(path, field)
