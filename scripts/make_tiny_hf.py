#!/usr/bin/env python
"""Make a small, randomly initialised Hugging Face Llama directory to try the HF workflow offline.

    python scripts/make_tiny_hf.py --out /tmp/tiny_hf                       # Llama-3-style tokenizer
    python scripts/make_tiny_hf.py --out /tmp/tiny_hf2 --tokenizer llama2 --rope-scaling llama3

Writes what ``LlamaForCausalLM.save_pretrained`` writes (config.json, model.safetensors) plus a
``tokenizer.json`` trained on the bundled State of the Union sample and a ``tokenizer_config.json``
naming its BOS/EOS tokens, the same files a real checkpoint (TinyLlama, OpenLLaMA, Llama 3) has.
Needs ``transformers`` (``pip install -e ".[dev]"``); no network.

The tokenizer builders are the ones the tests use: ``llama2_style_tokenizer`` (SentencePiece-like
BPE: "▁" word marker, byte fallback to <0xNN> tokens, <unk>/<s>/</s> at ids 0-2) and
``llama3_style_tokenizer`` (tiktoken-style regex split + byte-level BPE, special tokens
<|begin_of_text|>, <|end_of_text|>, <|eot_id|> after the merges).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

# Llama 3's pre-tokenizer pattern (tiktoken cl100k-like).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama2_style_tokenizer(texts: Iterable[str], vocab_size: int):
    """A Llama-2-style ``tokenizers.Tokenizer``: ids 0..2 = <unk>, <s>, </s>; 3..258 = <0x00>..<0xFF>
    (byte fallback for anything not in the vocabulary); then BPE pieces with the "▁" word marker."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = meta
    base.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size - 259, show_progress=False))
    learned = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def llama3_style_tokenizer(texts: Iterable[str], vocab_size: int):
    """A Llama-3-style ``tokenizers.Tokenizer``: regex split + byte-level BPE with ``vocab_size - 3``
    ids, then the special tokens <|begin_of_text|>, <|end_of_text|>, <|eot_id|>."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size - 3, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[(specials[0], bos)])
    return tok


TOKENIZER_SPECIALS = {"llama2": ("<s>", "</s>"), "llama3": ("<|begin_of_text|>", "<|end_of_text|>")}


def save_tokenizer(tok, out: Path, kind: str) -> None:
    """tokenizer.json + a tokenizer_config.json naming BOS/EOS, as HF model directories have them."""
    bos, eos = TOKENIZER_SPECIALS[kind]
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}, indent=1) + "\n")


def tiny_llama(vocab_size: int, *, layers: int = 2, hidden: int = 64, ffn: int = 128, heads: int = 4, kv_heads: int = 2,
               max_positions: int = 512, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
               tie: bool = False, bos_id: int | None = None, eos_id: int | None = None, seed: int = 0):
    """A randomly initialised fp32 ``LlamaForCausalLM`` (GQA when kv_heads < heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                      bos_token_id=bos_id, eos_token_id=eos_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--tokenizer", choices=sorted(TOKENIZER_SPECIALS), default="llama3")
    p.add_argument("--vocab-size", type=int, default=1024, help="tokenizer and model vocabulary (default 1024)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rope-scaling", choices=("none", "llama3"), default="none",
                   help="llama3: Llama 3.1's RoPE scaling (factor 8, original context 64 at this size)")
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from megatron_snip.data.corpus import bundled_sample_path, read_jsonl

    out = Path(args.out)
    build = llama3_style_tokenizer if args.tokenizer == "llama3" else llama2_style_tokenizer
    tok = build(read_jsonl(bundled_sample_path("sotu")), args.vocab_size)
    save_tokenizer(tok, out, args.tokenizer)
    bos, eos = (tok.token_to_id(t) for t in TOKENIZER_SPECIALS[args.tokenizer])
    model = tiny_llama(tok.get_vocab_size(), layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads,
                       kv_heads=args.kv_heads, rope_scaling=LLAMA3_SCALING if args.rope_scaling == "llama3" else None,
                       rope_theta=500000.0 if args.rope_scaling == "llama3" else 10000.0, tie=args.tie,
                       bos_id=bos, eos_id=eos, seed=args.seed)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e6:.2f}M-parameter Llama, vocab {tok.get_vocab_size()} ({args.tokenizer} tokenizer)")
    return out


if __name__ == "__main__":
    main()
