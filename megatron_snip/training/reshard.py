"""Our checkpoints as whole (unsharded) tensors, and rewriting them at another TP x PP layout.

A checkpoint written at layout (tp, pp) holds one shard per (tp_rank, pp_rank) (see
training/checkpoint.py). ``read_full`` reassembles the unsharded model weights and AdamW moments
keyed by parameter name (TP shards joined with the model's own shard spec, pipeline stages
merged by their global layer names); ``write_layout`` splits them again for any layout the model
allows and commits a new checkpoint at the same step, so a run resumes at the new layout.
``stage_state`` does the same for one rank on the fly: ``training.resume`` at another layout
loads the shard the conversion would have written for it, reading only its stage's parameters.

What carries over exactly: weights, AdamW moments and step counts, the LR schedule position,
the precision plan and its history, the CPU RNG state. Taken from shard (tp0, pp0) for every new
shard: the stochastic-rounding generator state and callbacks' extra state (SNIP's). Under
deterministic formats (bf16, fp8, RTN fp4) that is exact; with stochastic rounding each TP
shard/stage of the old run had consumed its own stream, so the new run's rounding draws differ
(statistically the same).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_snip.config import Config, load_config
from megatron_snip.model.layers import shard_state_dict, unshard_state_dicts
from megatron_snip.model.llama import LlamaModel
from megatron_snip.parallel.topology import ParallelTopology, TensorParallel
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.checkpoint_reader import open_checkpoint
from megatron_snip.training.optim import param_groups

_MOMENTS = ("exp_avg", "exp_avg_sq")


def resolve_checkpoint(path: str | Path, field: str = "checkpoint") -> tuple[Path, int]:
    """(checkpoint root, step) of ``path``, verified: a run directory (its newest checkpoint that
    verifies), a ``checkpoints/`` directory, or one ``checkpoints/step_N`` directory
    (``checkpoint_reader.open_checkpoint``, which also says which one it used)."""
    opened = open_checkpoint(path, field)
    return opened.root, opened.step


def run_config(ckpt_root: Path) -> Config:
    """The resolved config of the run that wrote the checkpoints under ``ckpt_root``."""
    path = ckpt_root.parent / "config.toml"
    if not path.is_file():
        raise ValueError(f"checkpoint {ckpt_root} has no run config at {path} (written at the start of every run); "
                         f"the checkpoint must stay inside its run directory")
    return load_config(path)


def stage_model(cfg: Config, vocab_size: int, tp: int, pp: int, tp_rank: int, pp_rank: int) -> LlamaModel:
    """The (tp_rank, pp_rank) shard of the model on the meta device: names, shapes, shard spec."""
    topo = ParallelTopology.from_rank(tp * pp, ParallelTopology.rank_of(tp_rank, pp_rank, 0, tp, 1), tp, pp)
    with torch.device("meta"):
        return LlamaModel(cfg.model, vocab_size, layers=topo.stage_layers(cfg.model.num_layers),
                          pre_process=topo.is_first_stage, post_process=topo.is_last_stage,
                          tp=TensorParallel(size=tp, rank=tp_rank), seed=0)


def _param_names(model: LlamaModel, weight_decay: float) -> list[str]:
    """Parameter names in the optimizer's index order (training/optim.py's groups)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in param_groups(model, weight_decay) for p in g["params"]]


@dataclass
class FullCheckpoint:
    """One checkpoint, unsharded.

    model: parameter name -> full fp32 tensor (every stage's).
    moments: parameter name -> {"exp_avg", "exp_avg_sq", "step"} (empty before the first step).
    param_groups: the optimizer's hyperparameter groups (without their ``params`` lists).
    common: the rest of shard (tp0, pp0): step, RNG states, plan, plan history, extra.
    meta: its meta.json; cfg: the run's config; vocab_size: V (embedding rows).
    """

    model: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    param_groups: list[dict[str, Any]]
    common: dict[str, Any]
    meta: dict[str, Any]
    cfg: Config
    vocab_size: int


def read_full(ckpt_root: Path, step: int, cfg: Config | None = None, *, with_optimizer: bool = True,
              only: Collection[str] | None = None) -> FullCheckpoint:
    """Read every shard of checkpoint ``step`` and join them (CPU memory: the whole model, plus
    twice that for the AdamW moments when ``with_optimizer``).

    ``only``: just these parameter names (one stage's, for ``stage_state``): the pipeline stages
    holding none of them are not read, and the others are memory-mapped, so of each shard only
    the bytes of those tensors (and shard (tp0, pp0)'s common state) are read."""
    cfg = cfg or run_config(ckpt_root)
    meta = ckpt.read_meta(ckpt_root, step)
    tp, pp = int(meta.get("tp", 1)), int(meta.get("pp", 1))
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    mmap = only is not None
    first = ckpt.read_shard(ckpt_root, step, 0, 0, mmap=mmap, finite=False)
    common = {k: v for k, v in first.items() if k not in ("model", "optimizer", "layout")}
    vocab_size = first["model"]["embedding.weight"].shape[0] * tp
    groups = [{k: v for k, v in g.items() if k != "params"} for g in first["optimizer"]["param_groups"]]
    for pp_rank in range(pp):
        stage = stage_model(cfg, vocab_size, tp, pp, 0, pp_rank)
        wanted = set(stage.state_dict()) if only is None else set(stage.state_dict()) & set(only)
        if not wanted:
            continue
        shards = [first if (tp_rank, pp_rank) == (0, 0)
                  else ckpt.read_shard(ckpt_root, step, tp_rank, pp_rank, mmap=mmap, finite=False)
                  for tp_rank in range(tp)]
        spec = stage.tp_shard_spec()
        model.update(unshard_state_dicts([{k: v for k, v in s["model"].items() if k in wanted} for s in shards], spec))
        if not with_optimizer:
            continue
        names = _param_names(stage, cfg.training.weight_decay)
        states = [s["optimizer"]["state"] for s in shards]
        for idx, name in enumerate(names):
            if idx not in states[0] or name not in wanted:
                continue  # no step taken yet, or not asked for
            full = unshard_state_dicts([{m: st[idx][m] for m in _MOMENTS} for st in states],
                                       dict.fromkeys(_MOMENTS, spec[name]))
            moments[name] = {**full, "step": states[0][idx]["step"]}
    ckpt.check_finite(model, f"checkpoint {ckpt.step_dir(ckpt_root, step)}")  # the tensors kept, only
    return FullCheckpoint(model, moments, groups, common, meta, cfg, vocab_size)


def check_layout(cfg: Config, vocab_size: int, tp: int, pp: int) -> None:
    """Refuse (naming the field, the value and the fix) a layout the model cannot be split into."""
    m = cfg.model
    for name, val in (("model.num_attention_heads", m.num_attention_heads), ("model.num_kv_heads", m.num_kv_heads),
                      ("model.ffn_hidden_size", m.ffn_hidden_size), ("vocabulary size", vocab_size)):
        if val % tp:
            raise ValueError(f"cannot reshard to tp={tp}: {name}={val} is not divisible by it; choose a tp that "
                             f"divides it")
    if m.num_layers % pp:
        raise ValueError(f"cannot reshard to pp={pp}: model.num_layers={m.num_layers} is not divisible by it "
                         f"(even layer split); choose a pp that divides it")


def shard_for(full: FullCheckpoint, stage: LlamaModel) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state dict, optimizer state dict) of ``stage`` (any TP shard / PP stage, on any device)
    cut from ``full``; the optimizer's groups follow training/optim.py with ``full``'s hyperparameters."""
    spec = stage.tp_shard_spec()
    tp, tp_rank = stage.tp.size, stage.tp.rank
    names = _param_names(stage, full.cfg.training.weight_decay)
    model = shard_state_dict({n: full.model[n] for n in stage.state_dict()}, spec, tp, tp_rank)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(names):
        if name in full.moments:
            mo = full.moments[name]
            sharded = shard_state_dict({m: mo[m] for m in _MOMENTS}, dict.fromkeys(_MOMENTS, spec[name]), tp, tp_rank)
            state[idx] = {"step": mo["step"].clone(), **sharded}
    groups, start = [], 0
    for g, proto in zip(param_groups(stage, full.cfg.training.weight_decay), full.param_groups, strict=True):
        groups.append({**copy.deepcopy(proto), "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return model, {"state": state, "param_groups": groups}


def shard_state(full: FullCheckpoint, stage: LlamaModel, pp: int, pp_rank: int) -> dict[str, Any]:
    """The checkpoint shard of ``stage`` (TP rank ``stage.tp.rank`` of pipeline stage ``pp_rank`` of
    ``pp``): ``full``'s common state (step, RNG, plan, history, extra), its model and optimizer
    slices, and its layout record."""
    model, optimizer = shard_for(full, stage)
    return {**copy.deepcopy(full.common), "model": model, "optimizer": optimizer,
            "layout": {"tp": stage.tp.size, "pp": pp, "tp_rank": stage.tp.rank, "pp_rank": pp_rank,
                       "layers": list(stage.layer_ids)}}


def stage_state(ckpt_root: Path, step: int, model: LlamaModel, pp: int, pp_rank: int) -> dict[str, Any]:
    """What ``checkpoint.read_shard`` would return to this rank had checkpoint ``step`` been written
    at its layout (``model``: its TP shard of pipeline stage ``pp_rank`` of ``pp``) - how
    ``training.resume`` continues at another TP x PP: the very shard ``write_layout``
    (scripts/reshard_checkpoint.py) writes for it, read from this stage's parameters only."""
    full = read_full(ckpt_root, step, only=list(model.state_dict()))
    return shard_state(full, model, pp, pp_rank)


def write_layout(full: FullCheckpoint, out_root: Path, tp: int, pp: int, *, keep: int = 1000) -> Path:
    """Write ``full`` as checkpoint ``step`` under ``out_root`` at layout (tp, pp); returns its directory.

    Every shard gets the same common state (see the module docstring for what that means under
    stochastic rounding). ``out_root`` may be a new run's ``checkpoints/`` (copy the run's
    config.toml next to it) or the source root itself (the checkpoint is replaced atomically)."""
    check_layout(full.cfg, full.vocab_size, tp, pp)
    step = int(full.meta["step"])
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            stage = stage_model(full.cfg, full.vocab_size, tp, pp, tp_rank, pp_rank)
            ckpt.write_shard(out_root, step, shard_state(full, stage, pp, pp_rank), tp_rank, pp_rank)
    meta = {**full.meta, "tp": tp, "pp": pp, "sequence_parallel": False,
            "resharded_from": {"tp": full.meta.get("tp", 1), "pp": full.meta.get("pp", 1)}}
    if isinstance(meta.get("config"), dict):  # the resolved config it records describes the new layout too
        meta["config"] = {**meta["config"], "parallel": {**meta["config"].get("parallel", {}), "tp": tp, "pp": pp}}
    return ckpt.commit(out_root, step, meta, keep=keep)
