"""Hugging Face Llama checkpoints (``config.json`` + safetensors) <-> megatron_snip models.

Name and layout mapping (HF ``LlamaForCausalLM`` -> ours, per block ``i``)::

    model.embed_tokens.weight                (V, D)      -> embedding.weight
    model.layers.i.input_layernorm.weight    (D,)        -> layers.i.attn_norm.weight
    model.layers.i.self_attn.{q,k,v}_proj    (H·Hd | G·Hd, D) -> layers.i.attn.qkv.weight, fused per kv group
                                                            as [q_0..q_{H/G-1}, k, v] (Megatron's layout)
    model.layers.i.self_attn.o_proj.weight   (D, H·Hd)   -> layers.i.attn.proj.weight
    model.layers.i.post_attention_layernorm  (D,)        -> layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up}_proj.weight (F, D) each -> layers.i.mlp.fc1.weight = [gate; up] (2F, D)
    model.layers.i.mlp.down_proj.weight      (D, F)      -> layers.i.mlp.fc2.weight
    model.norm.weight                        (D,)        -> final_norm.weight
    lm_head.weight (absent when tied)        (V, D)      -> lm_head.weight

RoPE layout: HF's Llama rotates the two halves of each head vector (``rotate_half``), and so
does model/rope.py, so q/k rows map unpermuted. (Meta's original ``consolidated.*.pth`` files
use interleaved pairs and need HF's ``permute`` first - convert them with transformers'
``convert_llama_weights_to_hf.py``; we read only HF directories.)

Tied embeddings: our model always has a separate LM head. A tied HF model is imported with the
head a copy of the embedding (identical logits); export ties them again only while they are
still bit-identical (training moves them apart; the export then writes an untied model).

Sharded loading: ``load_into_model`` fills a TP-shard / PP-stage ``LlamaModel`` reading only
that rank's slices of each tensor (``safe_open(...).get_slice``), so no rank ever holds the
full checkpoint. All tensors become fp32 (our master weights).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_snip.config import ModelConfig

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SUPPORTED_ROPE = ("default", "llama3")


# --- config ------------------------------------------------------------------------------------
def is_hf_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a Hugging Face model directory (has a config.json; our run directories
    have a config.toml). Missing safetensors are reported when the weights are read."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(hf_dir)!r} is not a Hugging Face model directory: it has no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore the model's config.json (e.g. copy it again "
                         f"from the model's source, or re-save it with save_pretrained)") from None


def _rope_params(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE parameters in one shape, from transformers>=5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` (whose type key is ``rope_type`` or ``type``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    return params


def model_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> tuple[ModelConfig, int, bool]:
    """(our ModelConfig, vocab size V, tie_word_embeddings) of an HF Llama ``config.json`` dict.

    Refuses, naming the field, what we cannot run: biases, another activation, a head_dim that
    is not hidden/heads, RoPE types other than default and llama3."""
    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"{where}: field {key!r} is missing; is this a Llama config.json?")
        return hf[key]

    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type={hf.get('model_type')!r}; only 'llama' (LlamaForCausalLM) is supported")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise ValueError(f"{where}: {key}={hf[key]!r} is not supported (our Llama has {key}={ok!r})")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ValueError(f"{where}: head_dim={head_dim} != hidden_size/num_attention_heads={hidden // heads}; "
                         f"only head_dim = hidden_size / heads is supported")
    rope = _rope_params(hf)
    if rope["rope_type"] not in _SUPPORTED_ROPE:
        raise ValueError(f"{where}: rope type {rope['rope_type']!r} is not supported; choose one of {_SUPPORTED_ROPE}")
    fields: dict[str, Any] = {
        "num_layers": int(need("num_hidden_layers")), "hidden_size": hidden,
        "ffn_hidden_size": int(need("intermediate_size")), "num_attention_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads), "vocab_size": int(need("vocab_size")),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)), "rope_base": float(rope["rope_theta"]),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "init_std": float(hf.get("initializer_range", 0.02))}
    if rope["rope_type"] == "llama3":
        fields.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_position=int(rope["original_max_position_embeddings"]))
    return ModelConfig(**fields), fields["vocab_size"], bool(hf.get("tie_word_embeddings", False))


def hf_config_from_model(cfg: ModelConfig, vocab_size: int, *, tie_word_embeddings: bool, dtype: torch.dtype,
                         bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict[str, Any]:
    """An HF ``LlamaConfig`` dict for our architecture (legacy ``rope_theta``/``rope_scaling`` keys,
    which transformers 4.x and 5.x both read)."""
    rope_scaling = None
    if cfg.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                        "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_position}
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "rope_scaling": rope_scaling, "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": cfg.init_std,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": dtype_name, "dtype": dtype_name,
    }


def check_model_matches(cfg: ModelConfig, vocab_size: int, hf_dir: str | os.PathLike, field_prefix: str) -> None:
    """Refuse (naming the field, both values and the fix) a model config that differs from the HF
    checkpoint's architecture; ``field_prefix`` names the option that pointed at ``hf_dir``."""
    hf_cfg, hf_vocab, _ = model_config_from_hf(read_hf_config(hf_dir), f"{hf_dir}/{CONFIG_FILE}")
    mismatches = [f"model.{f}={getattr(cfg, f)!r} but the checkpoint has {getattr(hf_cfg, f)!r}"
                  for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads",
                            "rope_base", "rope_scaling", "norm_eps")
                  if getattr(cfg, f) != getattr(hf_cfg, f)]
    if hf_cfg.rope_scaling == "llama3":
        mismatches += [f"model.{f}={getattr(cfg, f)!r} but the checkpoint has {getattr(hf_cfg, f)!r}"
                       for f in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                 "rope_original_max_position") if getattr(cfg, f) != getattr(hf_cfg, f)]
    if vocab_size != hf_vocab:
        mismatches.append(f"model vocabulary {vocab_size} (model.vocab_size={cfg.vocab_size}) but the checkpoint has "
                          f"{hf_vocab}")
    if mismatches:
        raise ValueError(f"config {field_prefix}={str(hf_dir)!r}: " + "; ".join(mismatches)
                         + f". Take the architecture from the checkpoint: python scripts/convert_hf.py config {hf_dir}"
                         " --out train.toml (prints the [model] section)")


# --- reading safetensors -------------------------------------------------------------------------
class HFCheckpointReader:
    """The tensors of an HF directory (one ``model.safetensors``, several files with an index, or
    any ``*.safetensors``), read lazily: ``read(name, dim, start, stop)`` loads only that slice."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / SAFETENSORS_INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{str(hf_dir)!r} has no *.safetensors files (PyTorch .bin checkpoints are not read; "
                             f"re-save the model with save_pretrained(..., safe_serialization=True))")
        self._handles = {f: self._open(safe_open, self.dir / f) for f in files}
        self._where = {k: f for f, h in self._handles.items() for k in h.keys()}  # noqa: SIM118 (not a dict)

    @staticmethod
    def _open(safe_open, path: Path):
        """safe_open, with an unreadable file (truncated, corrupt header, missing) named in a ValueError."""
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError, or OSError
            raise ValueError(f"{path} cannot be read as safetensors ({type(err).__name__}: {err}): the file is "
                             f"truncated or corrupt; download or save it again") from None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        if name not in self._where:
            raise ValueError(f"{self.dir}: tensor {name!r} is missing from the safetensors files")
        return self._handles[self._where[name]].get_slice(name)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` as fp32, or only ``[start:stop]`` along ``dim`` (0 or 1)."""
        sl = self._slice(name)
        dtype = sl.get_dtype()  # safetensors' names: F32, BF16, F16, F64, F8_E4M3, I64, U8, BOOL, ...
        if not dtype.startswith(("F", "BF")):
            raise ValueError(f"{self.dir / self._where[name]}: tensor {name!r} has dtype {dtype}, not a float; "
                             f"weights must be floating point (F32, BF16, F16) - is this a quantized or "
                             f"corrupted checkpoint? Use the unquantized model")
        try:
            if dim is None:
                t = sl[:]
            elif dim == 0:
                t = sl[start:stop]
            else:
                t = sl[:, start:stop]
        except Exception as err:  # noqa: BLE001 - a truncated data section surfaces only when read
            raise ValueError(f"{self.dir / self._where[name]}: tensor {name!r} cannot be read ({err}): the file is "
                             f"truncated or corrupt; download or save it again") from None
        return t.to(torch.float32)

    def names(self) -> list[str]:
        return sorted(self._where)


def _hf_block(i: int) -> str:
    return f"model.layers.{i}"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """q (G·(H/G)·Hd, D), k and v (G·Hd, D) -> our fused qkv (G·(H/G+2)·Hd, D), per group [q.., k, v]."""
    d = q.shape[1]
    parts = [q.reshape(num_groups, -1, k.shape[0] // num_groups, d), k.reshape(num_groups, 1, -1, d),
             v.reshape(num_groups, 1, -1, d)]
    return torch.cat(parts, dim=1).reshape(-1, d)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv`` for the full (unsharded) weight."""
    g, qpg, hd = cfg.num_kv_heads, cfg.num_attention_heads // cfg.num_kv_heads, cfg.head_dim
    x = qkv.reshape(g, qpg + 2, hd, qkv.shape[1])
    return (x[:, :qpg].reshape(-1, qkv.shape[1]), x[:, qpg].reshape(-1, qkv.shape[1]),
            x[:, qpg + 1].reshape(-1, qkv.shape[1]))


def _rows(n: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    per = n // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def read_param(reader: HFCheckpointReader, name: str, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0,
               tied: bool = False) -> torch.Tensor:
    """Our parameter ``name`` (its TP rank ``tp_rank`` shard of ``tp_size``) from the HF tensors,
    reading only the slices that shard needs."""
    parts = name.split(".")
    if name == "embedding.weight" or (name == "lm_head.weight" and tied):
        return reader.read("model.embed_tokens.weight", 0, *_rows(reader.shape("model.embed_tokens.weight")[0],
                                                                   tp_size, tp_rank))
    if name == "lm_head.weight":
        return reader.read("lm_head.weight", 0, *_rows(reader.shape("lm_head.weight")[0], tp_size, tp_rank))
    if name == "final_norm.weight":
        return reader.read("model.norm.weight")
    if parts[0] != "layers" or len(parts) not in (4, 5):
        raise ValueError(f"no Hugging Face tensor maps to parameter {name!r}")
    blk, sub = _hf_block(int(parts[1])), ".".join(parts[2:])
    g, qpg, hd, f = cfg.num_kv_heads, cfg.num_attention_heads // cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden_size
    if sub == "attn_norm.weight":
        return reader.read(f"{blk}.input_layernorm.weight")
    if sub == "mlp_norm.weight":
        return reader.read(f"{blk}.post_attention_layernorm.weight")
    if sub == "attn.qkv.weight":  # rank r: kv groups [g0, g1) and their query heads, contiguous in q/k/v
        g0, g1 = _rows(g, tp_size, tp_rank)
        q = reader.read(f"{blk}.self_attn.q_proj.weight", 0, g0 * qpg * hd, g1 * qpg * hd)
        k = reader.read(f"{blk}.self_attn.k_proj.weight", 0, g0 * hd, g1 * hd)
        v = reader.read(f"{blk}.self_attn.v_proj.weight", 0, g0 * hd, g1 * hd)
        return fuse_qkv(q, k, v, g1 - g0)
    if sub == "attn.proj.weight":
        return reader.read(f"{blk}.self_attn.o_proj.weight", 1, *_rows(cfg.num_attention_heads * hd, tp_size, tp_rank))
    if sub == "mlp.fc1.weight":  # [gate_r; up_r]
        r0, r1 = _rows(f, tp_size, tp_rank)
        return torch.cat([reader.read(f"{blk}.mlp.gate_proj.weight", 0, r0, r1),
                          reader.read(f"{blk}.mlp.up_proj.weight", 0, r0, r1)])
    if sub == "mlp.fc2.weight":
        return reader.read(f"{blk}.mlp.down_proj.weight", 1, *_rows(f, tp_size, tp_rank))
    raise ValueError(f"no Hugging Face tensor maps to parameter {name!r}")


def hf_tensor_names(cfg: ModelConfig, tied: bool) -> set[str]:
    """Every HF tensor name the whole model (all blocks, all stages) is read from."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    for i in range(cfg.num_layers):
        blk = _hf_block(i)
        names |= {f"{blk}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                                 "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


def unused_tensors(reader: HFCheckpointReader, cfg: ModelConfig, tied: bool) -> list[str]:
    """The tensors of the checkpoint that no parameter of this architecture is read from (a bias,
    an extra layer, another model's head): loading would silently drop them."""
    known = hf_tensor_names(cfg, tied)
    # older checkpoints save RoPE's inverse frequencies, a buffer derived from config.json's rope_theta
    return sorted(n for n in reader.names() if n not in known and not n.endswith("rotary_emb.inv_freq"))


@torch.no_grad()
def load_into_model(model, hf_dir: str | os.PathLike, *, ignore_unused: bool = False) -> None:
    """Copy an HF checkpoint into ``model`` (a ``LlamaModel``: any TP shard / PP stage of the
    architecture in ``hf_dir``), each parameter read as this rank's slice only.

    Raises ValueError naming the tensor on a shape mismatch (check the config first with
    ``check_model_matches`` for a friendlier message)."""
    hf = read_hf_config(hf_dir)
    _, _, tied = model_config_from_hf(hf, f"{hf_dir}/{CONFIG_FILE}")
    reader = HFCheckpointReader(hf_dir)
    tied = tied or "lm_head.weight" not in reader
    unused = unused_tensors(reader, model.cfg, tied)
    if unused and not ignore_unused:
        raise ValueError(f"{hf_dir}: {len(unused)} tensor(s) map to no parameter of this Llama and would be dropped: "
                         f"{unused[:5]}{' ...' if len(unused) > 5 else ''}; this is another architecture (biases, "
                         f"extra layers?) - check {hf_dir}/{CONFIG_FILE}, or set training.init_from_ignore_unused=true "
                         f"to load without them")
    for name, param in model.named_parameters():
        t = read_param(reader, name, model.cfg, model.tp.size, model.tp.rank, tied)
        if t.shape != param.shape:
            raise ValueError(f"{hf_dir}: parameter {name} (tp rank {model.tp.rank}/{model.tp.size}) needs shape "
                             f"{tuple(param.shape)} but the checkpoint gives {tuple(t.shape)}; the model config "
                             f"does not match {hf_dir}/{CONFIG_FILE}")
        param.copy_(t)


# --- writing -------------------------------------------------------------------------------------
def hf_state_dict(full: Mapping[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype = torch.float32
                  ) -> tuple[dict[str, torch.Tensor], bool]:
    """HF tensors of our *unsharded* state dict (all stages); returns (tensors, tied) where
    ``tied`` means the LM head equals the embedding bit for bit and is left out."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": full["embedding.weight"],
                                    "model.norm.weight": full["final_norm.weight"]}
    tied = torch.equal(full["embedding.weight"], full["lm_head.weight"])
    if not tied:
        out["lm_head.weight"] = full["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, blk = f"layers.{i}", _hf_block(i)
        q, k, v = split_qkv(full[f"{ours}.attn.qkv.weight"], cfg)
        gate, up = full[f"{ours}.mlp.fc1.weight"].chunk(2, dim=0)
        out.update({f"{blk}.input_layernorm.weight": full[f"{ours}.attn_norm.weight"],
                    f"{blk}.self_attn.q_proj.weight": q, f"{blk}.self_attn.k_proj.weight": k,
                    f"{blk}.self_attn.v_proj.weight": v, f"{blk}.self_attn.o_proj.weight": full[f"{ours}.attn.proj.weight"],
                    f"{blk}.post_attention_layernorm.weight": full[f"{ours}.mlp_norm.weight"],
                    f"{blk}.mlp.gate_proj.weight": gate, f"{blk}.mlp.up_proj.weight": up,
                    f"{blk}.mlp.down_proj.weight": full[f"{ours}.mlp.fc2.weight"]})
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in out.items()}, tied


def _file_groups(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += n
    if group:
        yield group


def save_hf(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any],
            max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``config.json`` and the tensors as safetensors: one ``model.safetensors``, or files of at
    most ``max_shard_bytes`` each with ``model.safetensors.index.json`` (HF's sharded layout).
    Returns the file names written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(dict(hf_config), indent=2) + "\n")
    groups = list(_file_groups(tensors, max_shard_bytes))
    meta = {"format": "pt"}
    if len(groups) == 1:
        save_file(dict(tensors), str(out / SINGLE_FILE), metadata=meta)
        return [CONFIG_FILE, SINGLE_FILE]
    names, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in group}, str(out / fname), metadata=meta)
        weight_map.update(dict.fromkeys(group, fname))
        names.append(fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2) + "\n")
    return [CONFIG_FILE, SAFETENSORS_INDEX, *names]



PLANS_FILE = "megatron_snip_plans.json"


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                      max_shard_bytes: int = 5 * 2**30, report: Any = None) -> Path:
    """Write our checkpoint ``path`` (a run directory = its latest checkpoint, or a step directory;
    any TP x PP layout) as an HF Llama directory ``out_dir`` that ``LlamaForCausalLM.from_pretrained``
    loads: config.json, safetensors, the run's tokenizer files when it used an HF tokenizer.json,
    and the precision plan history as ``megatron_snip_plans.json``. Returns ``out_dir``. ``report``
    (a ``str -> None`` callable) hears which checkpoint was used and, for a byte-tokenizer run,
    that no tokenizer was written. The checkpoint is verified before anything is written."""
    from megatron_snip.training.checkpoint_reader import open_checkpoint
    from megatron_snip.training.reshard import read_full

    opened = open_checkpoint(path, "checkpoint")  # verified: sha256 per shard, non-finite weights refused
    ckpt_root, step = opened.root, opened.step
    if report is not None:
        report(opened.note)
    full = read_full(ckpt_root, step, with_optimizer=False)
    tensors, tied = hf_state_dict(full.model, full.cfg.model, dtype)
    from megatron_snip.data.tokenizer import BPETokenizer

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
    hf_cfg = hf_config_from_model(full.cfg.model, full.vocab_size, tie_word_embeddings=tied, dtype=dtype,
                                  bos_token_id=bos_id, eos_token_id=eos_id)
    out = Path(out_dir)
    save_hf(out, tensors, hf_cfg, max_shard_bytes)
    for name, text in tok_files.items():
        (out / name).write_text(text)
    plans = {"step": step, "plan": full.common.get("plan"), "plan_history": full.common.get("plan_history", [])}
    (out / PLANS_FILE).write_text(json.dumps(plans, indent=1) + "\n")
    return out
