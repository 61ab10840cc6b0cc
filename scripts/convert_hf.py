#!/usr/bin/env python
"""Hugging Face Llama <-> megatron_snip.

    # a training config for an HF checkpoint: its architecture, its tokenizer, init_from it
    python scripts/convert_hf.py config /path/to/hf_llama --base launch/configs/tiny.toml --out train.toml
    # one of our checkpoints (run dir = latest, or run/checkpoints/step_N; any TP x PP layout) -> HF
    python scripts/convert_hf.py export runs/cpt --out /path/to/hf_out [--dtype bfloat16]

There is no separate import step: ``training.init_from=<hf dir>`` loads an HF directory straight
into any TP x PP layout (each rank reads only its slices). ``export`` writes config.json,
safetensors (sharded with an index above --max-shard-gb), the run's tokenizer files when it used
an HF tokenizer.json, and the precision plan history (megatron_snip_plans.json);
``LlamaForCausalLM.from_pretrained`` loads the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from megatron_snip.config import config_from_dict, load_config
from megatron_snip.interop import hf
from megatron_snip.training.export_hf import export_checkpoint


def hf_training_config(hf_dir: str, base: str | None, overrides: list[str]):
    """``base`` (a TOML config, or the defaults) with the [model] section of ``hf_dir``, its
    tokenizer.json (if present) and training.init_from = hf_dir."""
    model, vocab, _ = hf.model_config_from_hf(hf.read_hf_config(hf_dir), f"{hf_dir}/{hf.CONFIG_FILE}")
    raw = load_config(base, overrides).to_dict()
    raw["model"] = {**dataclasses.asdict(model), "vocab_size": vocab}
    tok = Path(hf_dir) / "tokenizer.json"
    if tok.is_file():
        raw["data"].update(tokenizer="bpe", tokenizer_path=str(tok.resolve()))
    raw["training"]["init_from"] = str(Path(hf_dir).resolve())
    cfg = config_from_dict(raw)
    if cfg.training.seq_len > model.max_position_embeddings:
        raise ValueError(f"training.seq_len={cfg.training.seq_len} exceeds the checkpoint's max_position_embeddings="
                         f"{model.max_position_embeddings}; pass --set training.seq_len=<smaller>")
    return cfg


def check_output(path: str, *, directory: bool) -> None:
    """Refuse, before anything is read or written, an ``--out`` that cannot be written: a file
    where a directory should be (or the reverse), a missing parent (``config``), no write access."""
    out = Path(path)
    want, other = ("directory", "file") if directory else ("file", "directory")
    if out.exists():
        if out.is_dir() != directory:
            raise ValueError(f"--out {path} is a {other}, not a {want}; choose another --out")
        target = out
    else:
        target = next(p for p in out.parents if p.exists())  # the nearest existing ancestor
        if not target.is_dir():
            raise ValueError(f"--out {path}: {target} is a file, not a directory; choose another --out")
        if not directory and target != out.parent:  # export creates its directories, config does not
            raise ValueError(f"--out {path}: the directory {out.parent} does not exist; create it or choose another --out")
    if not os.access(target, os.W_OK):
        raise ValueError(f"--out {path}: {target} is not writable; choose another --out")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="write a training config for an HF Llama directory")
    c.add_argument("hf_dir")
    c.add_argument("--base", default=None, help="TOML config to start from (default: the built-in defaults)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    c.add_argument("--out", required=True, help="TOML file to write")
    e = sub.add_parser("export", help="write one of our checkpoints as an HF Llama directory")
    e.add_argument("checkpoint", help="run directory (latest checkpoint) or run/checkpoints/step_N")
    e.add_argument("--out", required=True, help="directory to write")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="tensor dtype (default float32: bit-exact master weights)")
    e.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file before splitting")
    args = p.parse_args(argv)
    try:
        if args.cmd == "export" and not args.max_shard_gb > 0:
            raise ValueError(f"--max-shard-gb={args.max_shard_gb} must be positive (the largest safetensors file, in GiB)")
        check_output(args.out, directory=args.cmd == "export")
        if args.cmd == "config":
            cfg = hf_training_config(args.hf_dir, args.base, args.overrides)
            Path(args.out).write_text(cfg.to_toml())
            print(f"wrote {args.out}: {cfg.model.num_layers} layers, d={cfg.model.hidden_size}, vocab "
                  f"{cfg.model.vocab_size}, training.init_from={cfg.training.init_from}")
        else:
            out = export_checkpoint(args.checkpoint, args.out, dtype=getattr(torch, args.dtype),
                                    max_shard_bytes=int(args.max_shard_gb * 2**30),
                                    report=lambda line: print(f"note: {line}", file=sys.stderr))
            print(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
