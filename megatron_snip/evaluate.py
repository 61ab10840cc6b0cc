"""Evaluate a checkpoint: per-domain loss and perplexity, at any layout, in a plan of your choice.

    python -m megatron_snip.evaluate --checkpoint runs/tiny --valid-corpus moby_dick=bundled:moby_dick
    python -m megatron_snip.evaluate --checkpoint runs/tiny/checkpoints/step_000100 --plan uniform:nvfp4 \\
        --valid-corpus python_docs=corpus/python_docs.jsonl --max-sequences 256 --out eval.json
    torchrun --nproc_per_node=2 -m megatron_snip.evaluate --checkpoint runs/tiny --set parallel.tp=2

The model is the checkpoint run's (its config.toml), loaded as ``training.init_from`` loads it:
at the checkpoint's own layout each rank reads its shard, at any other each rank cuts its slice
(``parallel.tp`` / ``parallel.pp`` default to 1; data parallel takes the remaining ranks). Every
linear runs in ``--plan`` (``bf16`` by default; ``checkpoint`` = the plan in force when the
checkpoint was written; or any ``precision.initial_plan`` value: ``uniform:nvfp4``, a plan JSON).

Domains: ``valid`` (the held-out split of the run's training data; a blend's, plus each source's)
unless ``--no-held-out``, and one per ``--valid-corpus NAME=PATH`` (a JSONL file, an indexed
prefix or ``bundled:<name>``, tokenized with the run's tokenizer and used whole). Each is read
once, in windows of ``training.seq_len`` + 1 tokens, up to ``--max-sequences``: the first ones in
order (``--windows first``, the default) or that many spread evenly over the whole domain
(``--windows spread``: with ``--max-sequences`` = ``training.eval_batches`` x micro-batch, the
windows a run evaluates with ``training.eval_windows = "spread"``); the loss
is the mean next-token cross entropy in nats per token (per byte with the byte tokenizer), the
perplexity its exponential. Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_snip.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest checkpoint) or run/checkpoints/step_N")
    p.add_argument("--valid-corpus", action="append", default=[], metavar="NAME=PATH",
                   help="a domain to evaluate (repeatable): JSONL, indexed prefix or bundled:<name>")
    p.add_argument("--plan", default="bf16",
                   help="precision of every GEMM: bf16 (default), checkpoint (its own plan), uniform:<format>, a plan JSON")
    p.add_argument("--max-sequences", type=int, default=0, help="per domain (0 = all of it)")
    p.add_argument("--windows", choices=("first", "spread"), default="first",
                   help="which --max-sequences windows: the first in order, or spread over the whole domain")
    p.add_argument("--no-held-out", action="store_true", help="skip the run's held-out split")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override the run's config, e.g. --set parallel.tp=2 --set training.micro_batch_size=16")
    return p.parse_args(argv)


def parse_corpora(specs: list[str]) -> dict[str, str]:
    """``["NAME=PATH", ...]`` -> {NAME: PATH}; ValueError naming the bad one."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--valid-corpus {spec!r}: give NAME=PATH, e.g. moby_dick=bundled:moby_dick")
        if name in out or name == "valid":
            raise ValueError(f"--valid-corpus {spec!r}: the name {name!r} is taken; give each domain its own name")
        out[name] = path
    return out


def eval_config(checkpoint: str, plan_spec: str, overrides: list[str], run_dir: str) -> tuple[Any, Path, int]:
    """(config of the evaluation, checkpoint root, step): the checkpoint run's config with TP = PP = 1,
    the user's ``overrides``, then what an evaluation needs (init_from the checkpoint, SNIP off,
    the plan, a throwaway run directory)."""
    from megatron_snip.config import load_config
    from megatron_snip.training import checkpoint as ckpt
    from megatron_snip.training import reshard
    from megatron_snip.training.checkpoint_reader import open_checkpoint

    opened = open_checkpoint(checkpoint, "--checkpoint")  # sha256 of every shard; the newest that verifies
    root, step = opened.root, opened.step
    if os.environ.get("RANK", "0") == "0":  # which checkpoint, said once (torchrun sets RANK)
        print(opened.note, file=sys.stderr)
    run_cfg = root.parent / "config.toml"
    reshard.run_config(root)  # a clear error when the run's config.toml is missing
    if plan_spec == "checkpoint":  # only the plan is read here: the weights are checked when loaded
        plan = ckpt.read_shard(root, step, 0, 0, mmap=True, finite=False)["plan"]
        plan_spec = str(Path(run_dir) / "checkpoint_plan.json")
        Path(plan_spec).write_text(json.dumps(plan))
    forced = [f"training.init_from={json.dumps(str(ckpt.step_dir(root, step)))}", "training.init_optimizer=false",
              "training.resume=false", f"training.run_dir={json.dumps(run_dir)}", "training.progress=false",
              "snip.enabled=false", f"precision.initial_plan={json.dumps(plan_spec)}", "data.valid_paths=[]",
              "logging.wandb_project=\"\"", "logging.tensorboard=false"]
    layout = ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false"]
    cfg = load_config(run_cfg, [*layout, *overrides, *forced])
    return cfg, root, step


def evaluate_domains(trainer: Any, domains: dict[str, Any], max_sequences: int,
                     windows: str = "first") -> dict[str, dict[str, float]]:
    """One pass over ``max_sequences`` windows (0: all; ``windows``: the first or spread, as
    ``eval_micro_batches``) of each dataset of ``domains`` (this DP rank's share of each batch):
    mean loss over DP, perplexity, tokens and sequences read. The same on every rank."""
    import torch

    from megatron_snip.data.dataset import eval_micro_batches
    from megatron_snip.parallel import comm

    t, topo = trainer.cfg.training, trainer.topo
    out = {}
    trainer.model.eval()
    for name, ds in domains.items():
        total, batches = 0.0, 0
        reads = eval_micro_batches(ds, t.micro_batch_size, topo.dp_rank, topo.dp, max_sequences or None, windows)
        for tokens in reads:
            total += float(trainer.evaluate_batch(tokens.to(trainer.device)))
            batches += 1
        if batches == 0:
            raise ValueError(f"domain {name!r} holds {ds.num_windows} sequences of training.seq_len={t.seq_len} "
                             f"tokens, fewer than one batch (training.micro_batch_size={t.micro_batch_size} x "
                             f"{topo.dp} data-parallel ranks); lower them with --set or give more text")
        loss = torch.tensor(total / batches, dtype=torch.float64, device=trainer.device)
        loss = float(comm.all_reduce_mean(loss, topo.dp_group)) if topo.dp > 1 else float(loss)
        sequences = batches * t.micro_batch_size * topo.dp
        out[name] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "sequences": sequences,
                     "tokens": sequences * t.seq_len}
    return out


def run(args: argparse.Namespace, topo_factory: Any = None) -> dict[str, Any]:
    """Evaluate as ``args`` say on this rank; returns the results (also printed and written by rank 0)."""
    from megatron_snip.atomic_io import check_writable_file
    from megatron_snip.data.dataset import GPTDataset
    from megatron_snip.data.pipeline import open_indexed
    from megatron_snip.training import checkpoint as ckpt
    from megatron_snip.training.trainer import Trainer

    corpora = parse_corpora(args.valid_corpus)
    if args.max_sequences < 0:
        raise ValueError(f"--max-sequences={args.max_sequences}: give a number >= 0 (0 = the whole domain)")
    if args.out:
        check_writable_file(args.out, "--out")  # before the evaluation, not after it
    with tempfile.TemporaryDirectory(prefix="megatron_snip_eval_") as tmp:
        cfg, root, step = eval_config(args.checkpoint, args.plan, args.overrides, tmp)
        topo = topo_factory(cfg) if topo_factory is not None else None
        trainer = Trainer(cfg, topo)
        try:
            domains = {} if args.no_held_out else dict(trainer.data.valid)
            notes: list[str] = []
            for name, path in corpora.items():
                idx = open_indexed(path, trainer.data.tokenizer, cfg.data, check_ids=trainer.is_writer,
                                   field=f"--valid-corpus {name}", notes=notes)
                domains[name] = GPTDataset(idx, cfg.training.seq_len, trainer.data.tokenizer.eod_id, shuffle=False,
                                           label=f"--valid-corpus {name}={path}")
            for line in notes if trainer.is_writer else []:
                print(line, file=sys.stderr)
            if not domains:
                raise ValueError("nothing to evaluate: give --valid-corpus NAME=PATH or drop --no-held-out")
            results = evaluate_domains(trainer, domains, args.max_sequences, args.windows)
            plan = trainer.plan
        finally:
            trainer.logger.close()
    report = {"checkpoint": str(ckpt.step_dir(root, step)), "step": step, "plan": args.plan, "plan_policy": plan.policy,
              "windows": args.windows,
              "fp4_share": plan.fp4_flops_share, "layout": trainer.topo.describe().split(" | ")[0],
              "autocast": str(trainer.autocast_dtype), "domains": results}
    if trainer.is_writer:
        print(f"checkpoint {ckpt.step_dir(root, step)} step {step}, plan {args.plan} (FP4 share {plan.fp4_flops_share:.2f}), "
              f"{report['layout']}")
        width = max(len(n) for n in results)
        for name, r in results.items():
            print(f"  {name:<{width}}  loss {r['loss']:.4f}  ppl {r['ppl']:.3f}  ({r['sequences']} sequences, "
                  f"{r['tokens']} tokens)")
        if args.out:
            from megatron_snip.atomic_io import atomic_write_text

            atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    return report


def topo_for(cfg: Any) -> Any:
    """The process group of a torchrun launch (``cfg.parallel`` layout; data parallel over the rest),
    or None for one process."""
    from megatron_snip.parallel.distributed import env_world_size, init_distributed

    world = env_world_size()
    if world <= 1:
        return None
    cfg.validate(world)
    device = cfg.training.device
    return init_distributed(cfg.parallel.tp, cfg.parallel.pp, timeout_s=cfg.parallel.collective_timeout_s,
                            device_type=None if device == "auto" else device)


def main(argv: list[str] | None = None) -> int:
    from megatron_snip.parallel.distributed import destroy_distributed

    args = parse_args(argv)
    try:
        run(args, topo_for)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
