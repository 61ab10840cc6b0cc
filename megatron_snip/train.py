"""Entry point.

    python -m megatron_snip.train --config launch/configs/tiny.toml --set training.max_steps=60
    torchrun --standalone --nproc_per_node=4 -m megatron_snip.train --config ... --set parallel.tp=2
"""

from __future__ import annotations

import argparse
import sys

from megatron_snip.config import load_config

# Exit codes: 0 done, 1 no result, 2 bad input (config, data, checkpoint), 3 training stopped
# (non-finite steps or a ruinous update; the last checkpoint holds good weights), 4 another rank
# died or hung (parallel/watchdog.py), 75 preempted after writing a checkpoint (training/preemption.py).
EXIT_STOPPED = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_snip.precision.capability import GPUS

    p = argparse.ArgumentParser(prog="megatron-snip", description="Llama pretraining with SNIP adaptive precision")
    p.add_argument("--config", required=True, help="TOML config, e.g. launch/configs/tiny.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field (repeatable), e.g. --set training.max_steps=60")
    p.add_argument("--dry-run", action="store_true", help="validate and print sizing; start no process group")
    p.add_argument("--world-size", type=int, default=None, help="world size for --dry-run")
    p.add_argument("--gpu", default=None, choices=list(GPUS),
                   help="GPU type --dry-run checks the formats against (default: $MEGATRON_SNIP_GPU or h100)")
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

        try:
            print(dry_run_report(cfg, args.world_size or 1, gpu=args.gpu))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    from megatron_snip.atomic_io import ensure_writable_dir
    from megatron_snip.parallel.distributed import (
        destroy_distributed,
        env_rank,
        env_world_size,
        init_distributed,
        is_collective_failure,
    )
    from megatron_snip.parallel.watchdog import EXIT_HUNG, Heartbeat
    from megatron_snip.training.preemption import EXIT_PREEMPTED, TrainingPreempted
    from megatron_snip.training.run import run_training
    from megatron_snip.training.trainer import TrainingStopped

    if cfg.precision.backend == "emulated":
        # The emulated GEMMs allocate operand-sized temporaries every call; fixed glibc malloc
        # thresholds keep them mapped (~5% of a compiled nvfp4 step; see gemm.tune_cpu_malloc).
        from megatron_snip.precision.gemm import tune_cpu_malloc

        tune_cpu_malloc()

    heartbeat = None
    try:
        # torchrun sets WORLD_SIZE; a plain `python -m megatron_snip.train` runs one process, no process group.
        world_size = env_world_size()
        topo = None
        if world_size > 1:
            cfg.validate(world_size)  # fail on a bad layout before any rank waits in a collective
            device = cfg.training.device
            topo = init_distributed(cfg.parallel.tp, cfg.parallel.pp, timeout_s=cfg.parallel.collective_timeout_s,
                                    device_type=None if device == "auto" else device)
            run_dir = ensure_writable_dir(cfg.training.run_dir, "training.run_dir")
            heartbeat = Heartbeat(run_dir / "heartbeat", topo.rank, world_size,
                                  cfg.parallel.collective_timeout_s).start()
        result = run_training(cfg, topo, callbacks=[heartbeat] if heartbeat else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"error: training stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    except TrainingPreempted as e:
        print(f"preempted: {e}", flush=True)
        return EXIT_PREEMPTED
    except RuntimeError as e:
        # gloo raises a failed collective here; on NCCL a timeout never arrives as an exception
        # (torch's NCCL watchdog ends the process), so there the heartbeat alone names a hung rank.
        if not is_collective_failure(e):
            raise
        if heartbeat is not None:
            heartbeat.await_verdict()  # names the dead/hung rank and exits, if one stopped beating
        print(f"error: a collective failed on rank {env_rank()} at step {heartbeat.step if heartbeat else '?'} "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); another rank died or stopped "
              f"responding (parallel.collective_timeout_s={cfg.parallel.collective_timeout_s:g}) - see its log",
              file=sys.stderr)
        return EXIT_HUNG
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        destroy_distributed()
    return 0 if result is not None else 1


if __name__ == "__main__":
    sys.exit(main())
