"""The run directory's lifecycle: refusing a fresh run into a used directory, committing a
checkpoint from every rank's shard, and choosing (and checking) the checkpoint a run resumes from
- at any TP x PP layout: one saved at another is resharded on load (``training/reshard.py``).

``RunDirectory`` knows the files (``training.run_dir``, ``checkpoints/``, ``meta.json``) and the
order of the ranks' writes and barriers; what goes into a shard is the ``Trainer``'s
(``Trainer.state_dict`` / ``load_state_dict``). Every method is called on every rank of the
world group: rank 0 decides and broadcasts, so all ranks act alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_snip.atomic_io import ensure_writable_dir
from megatron_snip.config import Config
from megatron_snip.parallel import comm
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.telemetry.logger import RunLogger
from megatron_snip.telemetry.tensorboard_sink import check_log_dir
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training import reshard
from megatron_snip.training.checkpoint_reader import open_checkpoint
from megatron_snip.training.resume_check import compare


@dataclass
class Restored:
    """The checkpoint a run resumes from: this rank's shard, the step's ``meta.json`` and its folder."""

    state: dict[str, Any]
    meta: dict[str, Any]
    path: Path


class RunDirectory:
    """``training.run_dir`` and its ``checkpoints/`` for one rank of ``topo`` (rank 0 writes)."""

    def __init__(self, cfg: Config, topo: ParallelTopology) -> None:
        self.cfg = cfg
        self.topo = topo
        self.path = Path(cfg.training.run_dir)
        self.ckpt_root = self.path / "checkpoints"
        self.is_writer = topo.rank == 0
        self.start_notes: list[str] = []  # lines for the log once it exists (rank 0): what check_fresh cleaned up

    def check_fresh(self) -> None:
        """Refuse a fresh run (``training.resume=false``) into a directory that holds a run: its
        checkpoints would be pruned and its metrics mixed with ours. Rank 0 decides for everyone
        (before anything is written, so no rank sees this run's own files), checks the run's
        writable folders (``training.run_dir``, ``<run_dir>/tensorboard`` when asked for), and
        removes the temp directories of saves an earlier process left uncommitted (``start_notes``)."""
        verdict = None
        if self.is_writer:
            try:
                ensure_writable_dir(self.path, "training.run_dir")
                if self.cfg.logging.tensorboard:  # here, not in the sink: every rank gets the verdict
                    check_log_dir(self.path)
                if self.cfg.training.resume is False:
                    held = [p.name for p in (self.path / "metrics.jsonl", self.path / "config.toml")
                            if p.is_file() and p.stat().st_size > 0]
                    steps = ckpt.list_checkpoints(self.ckpt_root)
                    if steps:
                        held.append(f"checkpoints up to step {steps[-1]}")
                    if held:
                        verdict = (f"config training.run_dir={str(self.path)!r} already holds a run "
                                   f"({', '.join(held)}) and training.resume=false; continue it with "
                                   f"training.resume=auto, or choose a new training.run_dir (or delete the directory)")
                if verdict is None:  # before the broadcast: no rank saves before the stale temp dirs are gone
                    self.start_notes += ckpt.remove_interrupted_saves(self.ckpt_root)
            except ValueError as e:
                verdict = str(e)
        verdict = comm.broadcast_object(verdict, 0, self.topo.world_group)
        if verdict:
            raise ValueError(verdict)

    def save(self, step: int, state: dict[str, Any], layer_ids: list[int], meta: dict[str, Any] | None) -> None:
        """Write this rank's shard ``state`` (DP rank 0 of each (TP, PP) shard only, with its
        ``layout``: the stage's global ``layer_ids``), wait for every shard, then rank 0 commits
        checkpoint ``step`` atomically with ``meta`` as its ``meta.json`` (``meta`` is needed on
        rank 0 only; None elsewhere); every rank returns after the commit."""
        topo = self.topo
        if self.writes_shard:
            self.write_shard(step, state, layer_ids)
        comm.barrier(topo.world_group)  # all shards are in the temp dir before the commit
        self.commit(step, meta)
        comm.barrier(topo.world_group)  # nobody reads or re-saves before the commit is done

    @property
    def writes_shard(self) -> bool:
        """Whether this rank writes a shard: DP rank 0 of each (TP, PP) shard (the replicas hold the same)."""
        return self.topo.dp_rank == 0

    def write_shard(self, step: int, state: dict[str, Any], layer_ids: list[int],
                    on_partial: Any = None) -> None:
        """Write this rank's shard of checkpoint ``step`` into its temp dir (no collective: the
        asynchronous writer thread calls it too; ``on_partial``: see ``checkpoint.write_shard``)."""
        topo = self.topo
        state["layout"] = {"tp": topo.tp, "pp": topo.pp, "tp_rank": topo.tp_rank,
                           "pp_rank": topo.pp_rank, "layers": list(layer_ids)}
        ckpt.write_shard(self.ckpt_root, step, state, topo.tp_rank, topo.pp_rank, on_partial=on_partial)

    def commit(self, step: int, meta: dict[str, Any] | None) -> None:
        """Rank 0 commits checkpoint ``step`` (``checkpoint.commit``); a no-op elsewhere. Call it only
        once every rank's shard is written (a barrier, or the asynchronous writers' agreement)."""
        if self.is_writer:
            assert meta is not None, "rank 0 commits the checkpoint and needs its meta"
            ckpt.commit(self.ckpt_root, step, meta, keep=self.cfg.training.keep_checkpoints)

    def latest(self, logger: RunLogger, vocab_size: int, layer_ids: list[int]) -> Restored | None:
        """The newest checkpoint that verifies (``training.resume``), read for this rank; None if
        there is none (then ``metrics.jsonl`` is emptied: records of an attempt that never
        checkpointed).

        Rank 0 picks it with ``checkpoint_reader.open_checkpoint`` (the reader evaluate,
        init_from, export and reshard use: every shard's sha256, newest first), sets aside the ones that
        fail (``checkpoints/rejected_step_N``, each reason logged) and picks the step, so every
        rank loads the same checkpoint. The checkpoint's config is compared with this run's
        (``resume_check``): a change the checkpoint cannot take is refused naming the field and
        both values; the others are listed with what they do. ``vocab_size`` and ``layer_ids``
        (this stage's global layers) must match the checkpoint's."""
        topo = self.topo
        decision: dict[str, Any] = {}
        if self.is_writer:  # the one reader every path uses (checkpoint_reader), plus setting the rejects aside
            try:
                opened = open_checkpoint(self.ckpt_root, "config training.run_dir", missing_ok=True,
                                         none_verify_fix="restore one from a copy, or start a new training.run_dir")
                decision = {"step": None if opened is None else opened.step,
                            "skipped": [] if opened is None else opened.skipped}
            except ckpt.CheckpointError as e:
                decision = {"error": str(e)}
            if decision.get("step") is not None:
                for bad in ckpt.list_checkpoints(self.ckpt_root):
                    if bad > decision["step"]:
                        ckpt.set_aside(self.ckpt_root, bad)
        decision = comm.broadcast_object(decision, 0, topo.world_group)
        if "error" in decision:
            raise ckpt.CheckpointError(decision["error"])
        step, skipped = decision["step"], decision["skipped"]
        for reason in skipped:
            logger.info(f"skipping checkpoint: {reason}")
        if step is None:
            logger.info(f"training.resume={self.cfg.training.resume!r}: no checkpoint in {self.ckpt_root}; "
                        f"starting from scratch")
            logger.truncate_metrics(0)  # records of an attempt that never checkpointed
            return None
        meta = ckpt.read_meta(self.ckpt_root, step)
        d = ckpt.step_dir(self.ckpt_root, step)
        if "config" in meta:
            refusals, notes = compare(meta["config"], self.cfg.to_dict())
            if meta.get("vocab_size", vocab_size) != vocab_size:
                refusals.append(f"vocabulary size (model.vocab_size or the tokenizer's): {meta['vocab_size']} -> "
                                f"{vocab_size} (the embedding has the old shape)")
            if refusals:
                raise ValueError(f"cannot resume from {d}: " + "; ".join(refusals) + ". Restore the checkpoint's "
                                 f"values (see {self.path / 'config.toml'}) or start a new training.run_dir")
            for note in notes:
                logger.info(f"resume: changed {note}")
        saved_layout = (meta.get("tp", 1), meta.get("pp", 1))
        if saved_layout == (topo.tp, topo.pp):
            state = ckpt.read_shard(self.ckpt_root, step, topo.tp_rank, topo.pp_rank)
        else:  # the shard scripts/reshard_checkpoint.py would have written for this rank, made on load
            stage = reshard.stage_model(self.cfg, vocab_size, topo.tp, topo.pp, topo.tp_rank, topo.pp_rank)
            state = reshard.stage_state(self.ckpt_root, step, stage, topo.pp, topo.pp_rank)
            logger.info(f"resume: {d} was saved at tp={saved_layout[0]} pp={saved_layout[1]}; resharded on load to "
                        f"tp={topo.tp} pp={topo.pp} (each rank read its stage's parameters)")
        layout = state.get("layout")
        if layout is not None and layout["layers"] != list(layer_ids):
            raise ValueError(f"checkpoint shard for tp_rank={topo.tp_rank} pp_rank={topo.pp_rank} holds "
                             f"layers {layout['layers']}, this stage has {list(layer_ids)}; resume with "
                             f"the same model.num_layers and parallel.pp")
        return Restored(state, meta, d)
