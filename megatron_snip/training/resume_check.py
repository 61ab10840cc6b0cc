"""What may change between a checkpoint's run and the run resuming from it.

``compare(saved, current)`` takes two resolved configs as nested dicts (``Config.to_dict()``)
and sorts every differing field into
  * a refusal - the checkpoint cannot be loaded into the new model, or the data position
    (step * global_batch_size sequences of the seeded shuffle) would point elsewhere, or
  * a note - allowed, with what the change does from the resumed step on.
Fields not listed in either table are allowed with the generic note of their section.
The TP/PP layout is not compared here: a checkpoint records the layout of its shards
(``meta.json`` tp/pp), and one saved at another layout is resharded on load (``training/reshard.py``).
"""

from __future__ import annotations

from typing import Any

from megatron_snip.config.sections import megatron_blend_string

# field -> why it cannot change on resume
REFUSED: dict[str, str] = {
    **{f"model.{k}": "the checkpoint's weights have the old shape/architecture" for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "vocab_size",
        "rope_base", "norm_eps")},
    "training.global_batch_size": "the data position is step * global_batch_size sequences",
    "training.seq_len": "the data windows (and so the data position) depend on it",
    "training.seed": "it seeds the data shuffle, so the data position would point at other sequences",
    "data.train_path": "the data position indexes the old corpus",
    "data.split": "the train/valid split of the corpus would change",
    "data.shuffle_seed": "it orders the training windows, so the data position would point at other sequences",
    "data.tokenizer": "the token ids (and the data position) would change",
    "data.tokenizer_path": "the token ids (and the data position) would change",
    "data.bpe_vocab_size": "the token ids (and the data position) would change",
    "data.json_key": "the corpus text (and so the data position) would change",
}

# field -> what the allowed change does
NOTES: dict[str, str] = {
    "training.max_steps": "the run length changes; the LR schedule is recomputed for the new length",
    "training.lr": "the LR schedule changes from the resumed step on",
    "training.min_lr": "the LR schedule changes from the resumed step on",
    "training.lr_schedule": "the LR schedule changes from the resumed step on",
    "training.warmup_steps": "the LR schedule changes from the resumed step on",
    "training.micro_batch_size": "same data per step, split into other micro-batches (losses differ in the last bits)",
    "precision.initial_plan": "ignored: the plan in force comes from the checkpoint",
    "model.init_std": "ignored: the weights come from the checkpoint",
}
SECTION_NOTES: dict[str, str] = {
    "model": "takes effect from the resumed step",
    "parallel": "takes effect from the resumed step",
    "precision": "takes effect from the resumed step",
    "snip": "takes effect at the next re-plan",
    "training": "takes effect from the resumed step",
    "data": "takes effect from the resumed step (validation/cache only)",
    "logging": "takes effect from the resumed step",
}
IGNORED = {"training.resume"}


def compare(saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(refusals, notes), each one line per changed field: ``section.field: old -> new (why)``."""
    refusals, notes = [], []
    for section in sorted(set(saved) | set(current)):
        old_s, new_s = saved.get(section) or {}, current.get(section) or {}
        for key in sorted(set(old_s) | set(new_s)):
            name = f"{section}.{key}"
            if name in IGNORED or key not in old_s:  # a field added since the checkpoint: nothing to compare
                continue
            old, new = old_s.get(key), new_s.get(key)
            if _norm(name, old) == _norm(name, new):
                continue
            line = f"{name}: {old!r} -> {new!r}"
            if name in REFUSED:
                refusals.append(f"{line} ({REFUSED[name]})")
            else:
                notes.append(f"{line} ({NOTES.get(name, SECTION_NOTES.get(section, 'allowed'))})")
    return refusals, notes


def _norm(name: str, v: Any) -> Any:
    """One spelling per value: a tuple as a list; a blend in Megatron's string form as its list form
    (``"0.7 a 0.3 b"`` is ``["0.7", "a", "0.3", "b"]``, the same data position)."""
    if name == "data.train_path" and isinstance(v, str):
        v = megatron_blend_string(v) or v
    return list(v) if isinstance(v, tuple) else v
