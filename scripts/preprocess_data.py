#!/usr/bin/env python
"""Tokenize a JSONL corpus into a Megatron-LM indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

    python scripts/preprocess_data.py --input sotu.jsonl --output-prefix out/sotu --tokenizer byte
    python scripts/preprocess_data.py --input sotu.jsonl --output-prefix out/sotu --tokenizer bpe \\
        --tokenizer-path out/tok4096.json --vocab-size 4096 --workers 2

Flags follow Megatron's tools/preprocess_data.py where they mean the same (--input,
--output-prefix, --json-keys, --append-eod, --workers). Differences: the files are written to
PREFIX.bin/.idx exactly (Megatron appends "_<key>_document"), EOD is appended by default
(--no-append-eod to turn off), and --tokenizer-path for bpe is loaded if it exists, otherwise a
tokenizer is trained on --input and saved there. A PREFIX.json with the statistics is written too.
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_snip.data.corpus import read_jsonl, tokenize_to_indexed
from megatron_snip.data.indexed import IndexedDataset, bin_path, idx_path
from megatron_snip.data.tokenizer import build_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file (.jsonl or .jsonl.gz), one document per line")
    p.add_argument("--output-prefix", required=True, help="write OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--json-key", "--json-keys", dest="json_key", default="text", help="field holding the text (default: text)")
    p.add_argument("--tokenizer", "--tokenizer-type", dest="tokenizer", choices=("byte", "bpe"), required=True)
    p.add_argument("--tokenizer-path", "--tokenizer-model", dest="tokenizer_path", default=None,
                   help="bpe: tokenizer.json to load, or where to save one trained on --input")
    p.add_argument("--vocab-size", type=int, default=4096, help="bpe training vocabulary (default 4096)")
    p.add_argument("--eod-token", default="", help="bpe: end-of-document token (default: the tokenizer's own eos, "
                   "from its tokenizer_config.json or a known name); must match the training config's data.eod_token")
    p.add_argument("--bos-token", default="", help="bpe: token put before each document (default: the tokenizer's "
                   "own bos, if any; 'none' for no BOS); must match data.bos_token")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True, help="end each document with EOD (default on)")
    p.add_argument("--workers", type=int, default=1, help="encoding processes (default 1; BPE is multi-threaded already)")
    args = p.parse_args(argv)
    if args.tokenizer == "bpe" and args.tokenizer_path is None:
        p.error("--tokenizer bpe needs --tokenizer-path (an existing tokenizer.json, or where to save the trained one)")
    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    texts = None
    if args.tokenizer == "bpe" and not os.path.isfile(args.tokenizer_path):
        print(f"training a {args.vocab_size}-token byte-level BPE on {args.input} -> {args.tokenizer_path}", flush=True)
        texts = read_jsonl(args.input, args.json_key)
    tok = build_tokenizer(args.tokenizer, args.tokenizer_path, texts=texts, vocab_size=args.vocab_size,
                          eod_token=args.eod_token, bos_token=args.bos_token)
    print(f"tokenizer: {tok}", flush=True)
    stats = tokenize_to_indexed(read_jsonl(args.input, args.json_key), tok, args.output_prefix,
                                append_eod=args.append_eod, workers=args.workers, progress=True)
    ds = IndexedDataset(args.output_prefix)
    stats.update(source=os.path.abspath(args.input), tokenizer=tok.kind, tokenizer_identity=tok.identity(),
                 vocab_size=tok.vocab_size, raw_vocab_size=tok.raw_vocab_size, eod_id=tok.eod_id,
                 bos_id=tok.bos_id, dtype=str(ds.dtype), json_key=args.json_key,
                 append_eod=args.append_eod, bytes_per_token=stats["text_bytes"] / max(stats["tokens"], 1))
    with open(args.output_prefix + ".json", "w") as f:
        json.dump(stats, f, indent=1)
    print(f"{stats['documents']} documents, {stats['tokens']} tokens ({ds.dtype}), "
          f"{stats['bytes_per_token']:.3f} bytes/token, {stats['seconds']:.2f} s "
          f"({stats['text_bytes'] / 1e6 / max(stats['seconds'], 1e-9):.1f} MB/s)", flush=True)
    print(f"wrote {bin_path(args.output_prefix)} and {idx_path(args.output_prefix)}", flush=True)
    return stats


if __name__ == "__main__":
    main()
