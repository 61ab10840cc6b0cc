"""Export our checkpoints as Hugging Face Llama directories (``scripts/convert_hf.py export``).

Reading our checkpoint (any TP x PP layout, ``training/reshard.read_full``) is training's; the
conversion of the unsharded state dict and config to HF tensors and ``config.json`` is
``interop/hf.py``'s, which knows nothing of our checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_snip.data.tokenizer import BPETokenizer
from megatron_snip.interop import hf
from megatron_snip.training.checkpoint_reader import open_checkpoint
from megatron_snip.training.reshard import read_full

PLANS_FILE = "megatron_snip_plans.json"


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                      max_shard_bytes: int = 5 * 2**30, report: Callable[[str], None] | None = None) -> Path:
    """Write our checkpoint ``path`` (a run directory = its latest checkpoint, or a step directory;
    any TP x PP layout) as an HF Llama directory ``out_dir`` that ``LlamaForCausalLM.from_pretrained``
    loads: config.json, safetensors, the run's tokenizer files when it used an HF tokenizer.json,
    and the precision plan history as ``megatron_snip_plans.json``. Returns ``out_dir``. ``report``
    (a ``str -> None`` callable) hears which checkpoint was used and, for a byte-tokenizer run,
    that no tokenizer was written. The checkpoint is verified before anything is written."""
    opened = open_checkpoint(path, "checkpoint")  # verified: sha256 per shard, non-finite weights refused
    ckpt_root, step = opened.root, opened.step
    if report is not None:
        report(opened.note)
    full = read_full(ckpt_root, step, with_optimizer=False)
    tensors, tied = hf.hf_state_dict(full.model, full.cfg.model, dtype)
    tok_files, bos_id, eos_id = {}, None, None
    data = full.cfg.data
    if data.tokenizer != "bpe" and report is not None:  # the byte tokenizer has no HF counterpart
        report(f"the run used data.tokenizer={data.tokenizer!r}, which has no Hugging Face counterpart: no tokenizer "
               f"files are written, so lm_eval --model hf (and AutoTokenizer) cannot load {out_dir}; train with "
               f"data.tokenizer=bpe for the lm_eval route, or pass your own tokenizer to lm_eval (tokenizer=...)")
    if data.tokenizer == "bpe":
        if not os.path.isfile(data.tokenizer_path):
            raise ValueError(f"the run's data.tokenizer_path={data.tokenizer_path!r} ({ckpt_root.parent / 'config.toml'}) "
                             f"no longer exists; restore it to export the tokenizer with the model")
        tok = BPETokenizer.from_file(data.tokenizer_path, eod_token=data.eod_token, bos_token=data.bos_token)
        tok_files = tok.hf_files()
        bos_id, eos_id = tok.bos_id, tok.eod_id
    hf_cfg = hf.hf_config_from_model(full.cfg.model, full.vocab_size, tie_word_embeddings=tied, dtype=dtype,
                                     bos_token_id=bos_id, eos_token_id=eos_id)
    out = Path(out_dir)
    hf.save_hf(out, tensors, hf_cfg, max_shard_bytes)
    for name, text in tok_files.items():
        (out / name).write_text(text)
    plans = {"step": step, "plan": full.common.get("plan"), "plan_history": full.common.get("plan_history", [])}
    (out / PLANS_FILE).write_text(json.dumps(plans, indent=1) + "\n")
    return out
