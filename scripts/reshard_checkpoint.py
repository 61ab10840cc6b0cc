#!/usr/bin/env python
"""Convert one of our checkpoints to another tensor/pipeline-parallel layout, optimizer state included.

    python scripts/reshard_checkpoint.py runs/tiny --tp 1 --pp 1                   # in place (latest checkpoint)
    python scripts/reshard_checkpoint.py runs/tiny/checkpoints/step_000200 --tp 2 --pp 2 --out runs/tiny_tp2pp2

In place, the checkpoint is replaced atomically at the same step; then resume with the new
``parallel.tp``/``parallel.pp`` (``--set training.resume=true``). With ``--out`` a new run
directory is made (its config.toml is the source run's with the new layout). What is exact and
what is not (stochastic-rounding streams): see megatron_snip/training/reshard.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from megatron_snip.atomic_io import atomic_write_text
from megatron_snip.training import reshard
from megatron_snip.training.checkpoint_reader import open_checkpoint


def _check_out(out_run: Path, src_run: Path) -> None:
    """A new run directory only: never the source run, never one that already holds files."""
    if out_run.resolve() == src_run.resolve():
        raise ValueError(f"--out {out_run} is the source run directory; omit --out to convert it in place")
    if out_run.exists() and (not out_run.is_dir() or any(out_run.iterdir())):
        raise ValueError(f"--out {out_run} already exists and is not an empty directory; choose a new directory")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="run directory (its latest checkpoint) or run/checkpoints/step_N")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--out", default=None, help="new run directory (default: convert in place)")
    args = p.parse_args(argv)
    try:
        # Everything is checked before anything is written: the source's checksums (as resume
        # does: a corrupt shard must not come out re-checksummed as "verified"), the new layout,
        # and the destination.
        for flag, val in (("--tp", args.tp), ("--pp", args.pp)):
            if val < 1:
                raise ValueError(f"{flag}={val} must be a positive integer")
        opened = open_checkpoint(args.checkpoint, "checkpoint")  # sha256 of every shard (the newest that verifies)
        root, step = opened.root, opened.step
        print(f"note: {opened.note}", file=sys.stderr)
        full = reshard.read_full(root, step)
        reshard.check_layout(full.cfg, full.vocab_size, args.tp, args.pp)
        out_root = root
        if args.out is not None:
            out_run = Path(args.out)
            _check_out(out_run, root.parent)
            cfg = dataclasses.replace(full.cfg, parallel=dataclasses.replace(full.cfg.parallel, tp=args.tp, pp=args.pp,
                                                                               sequence_parallel=False),
                                      training=dataclasses.replace(full.cfg.training, run_dir=str(out_run)))
            atomic_write_text(out_run / "config.toml", cfg.to_toml())
            out_root = out_run / "checkpoints"
        d = reshard.write_layout(full, out_root, args.tp, args.pp)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {d}: tp={args.tp} pp={args.pp} (from tp={full.meta.get('tp')} pp={full.meta.get('pp')}, step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
