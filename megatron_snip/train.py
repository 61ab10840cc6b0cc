"""Entry point.

    python -m megatron_snip.train --config launch/configs/tiny.toml --set training.max_steps=60
    torchrun --standalone --nproc_per_node=4 -m megatron_snip.train --config ... --set parallel.tp=2
"""

from __future__ import annotations

import argparse
import sys

from megatron_snip.config import load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-snip", description="Llama pretraining with SNIP adaptive precision")
    p.add_argument("--config", required=True, help="TOML config, e.g. launch/configs/tiny.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field (repeatable), e.g. --set training.max_steps=60")
    p.add_argument("--dry-run", action="store_true", help="validate and print sizing; start no process group")
    p.add_argument("--world-size", type=int, default=None, help="world size for --dry-run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megatron_snip.sizing import dry_run_report

        print(dry_run_report(cfg, args.world_size or 1))
        return 0
    from megatron_snip.training.run import run_training

    try:
        result = run_training(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if result is not None else 1


if __name__ == "__main__":
    sys.exit(main())
