"""``training.init_from``: start a new run (step 0, its own run directory) from existing weights.

Sources, told apart by their files:
  * a Hugging Face Llama directory (config.json + *.safetensors): each rank reads only its TP
    shard / PP stage slices (interop/hf.py); there is no optimizer state to take;
  * one of our checkpoints - a run directory (its newest checkpoint that verifies), its
    ``checkpoints/``, or one ``checkpoints/step_N`` (training/checkpoint_reader.py: each shard's
    sha256 is checked and non-finite weights are refused, naming the shard or the tensor): the weights, and with ``training.init_optimizer`` the AdamW moments
    and step counts. At the checkpoint's own TP x PP layout each rank reads its own shard; at
    another layout every rank reads the whole checkpoint and keeps its slice (training/reshard.py).

Only weights (and moments) are taken: the step, LR schedule, data order, RNG and precision plan
are the new run's. The new run's optimizer hyperparameters (lr, betas, weight decay) stay those
of its config even when the moments come from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_snip.config import Config
from megatron_snip.interop import hf
from megatron_snip.model.llama import LlamaModel
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training import reshard
from megatron_snip.training.checkpoint_reader import open_checkpoint

FIELD = "training.init_from"
_ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads")


def init_from(source: str, model: LlamaModel, optimizer: torch.optim.Optimizer, cfg: Config, *,
              tp_rank: int, pp_rank: int) -> str:
    """Load ``source`` into this rank's ``model`` (and ``optimizer`` if ``cfg.training.init_optimizer``);
    returns a one-line description for the log. Errors name the path, the field and the fix."""
    if not Path(source).exists():
        raise ValueError(f"config {FIELD}={source!r} does not exist; give a run directory, a checkpoint directory "
                         f"(run/checkpoints/step_N) or a Hugging Face Llama directory")
    if hf.is_hf_dir(source):
        if cfg.training.init_optimizer:
            raise ValueError(f"config training.init_optimizer=true but {FIELD}={source!r} is a Hugging Face "
                             f"directory, which has no optimizer state; set training.init_optimizer=false")
        hf.check_model_matches(cfg.model, model.vocab_size, source, FIELD)
        hf.load_into_model(model, source, ignore_unused=cfg.training.init_from_ignore_unused)
        return f"initialized from Hugging Face checkpoint {source}"
    opened = open_checkpoint(source, f"config {FIELD}")  # every shard's sha256 checked; non-finite weights refused
    root, step = opened.root, opened.step
    src_cfg = reshard.run_config(root)
    mismatches = [f"model.{f}={getattr(cfg.model, f)} but the checkpoint's run has {getattr(src_cfg.model, f)}"
                  for f in _ARCH_FIELDS if getattr(cfg.model, f) != getattr(src_cfg.model, f)]
    if mismatches:
        raise ValueError(f"config {FIELD}={source!r} ({ckpt.step_dir(root, step)}): " + "; ".join(mismatches)
                         + f"; set these model fields as in {root.parent / 'config.toml'}")
    meta = ckpt.read_meta(root, step)
    try:  # the reads refuse non-finite weights naming the tensor; the message also names the field
        if (meta.get("tp", 1), meta.get("pp", 1)) == (model.tp.size, cfg.parallel.pp):
            state = ckpt.read_shard(root, step, tp_rank, pp_rank)
            model_sd, optim_sd = state["model"], state["optimizer"]
        else:
            full = reshard.read_full(root, step, src_cfg, with_optimizer=cfg.training.init_optimizer)
            model_sd, optim_sd = reshard.shard_for(full, model)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"config {FIELD}={source!r}: {e}") from None
    _check_shapes(model, model_sd, source, root, step)
    model.load_state_dict(model_sd)
    what = "weights"
    if cfg.training.init_optimizer:
        # The moments come from the checkpoint; the hyperparameters stay this run's.
        optimizer.load_state_dict({"state": optim_sd["state"], "param_groups": optimizer.state_dict()["param_groups"]})
        what = "weights and optimizer state"
    return (f"initialized {what} from {ckpt.step_dir(root, step)} (step {step}, tp={meta.get('tp')} "
            f"pp={meta.get('pp')}); {opened.note}")


def _check_shapes(model: LlamaModel, state: dict[str, torch.Tensor], source: str, root: Path, step: int) -> None:
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"config {FIELD}={source!r}: {ckpt.step_dir(root, step)} lacks parameters {missing[:3]}; "
                         f"it is not a checkpoint of this model architecture")
    for name, t in own.items():
        if tuple(state[name].shape) != tuple(t.shape):
            fix = ("set model.vocab_size to the checkpoint's vocabulary (embedding rows x tp) and use its tokenizer"
                   if name in ("embedding.weight", "lm_head.weight") else "use the checkpoint run's model config")
            raise ValueError(f"config {FIELD}={source!r}: parameter {name} is {tuple(state[name].shape)} in "
                             f"{ckpt.step_dir(root, step)} but {tuple(t.shape)} in this model; {fix}")
