"""Stops in a distributed run (issue #24 item 3 follow-up): the stop flag (reduced in each step's
skip-flag all-reduce) and the post-step guard's flag reach every rank's host one step after the
step that produced them (``step_guard.LaggedFlags``), not at the next log step. So with the flag
of step ``s`` set, every rank stops at the boundary after step ``s + 1``: a signal that arrives
before step ``s``'s flags are reduced stops the run after step ``s + 1``, one that arrives after
them after step ``s + 2``. ``training.log_interval=10`` puts the next read step far away: on the
code that acted only at read steps these runs stopped at step 10 (preemption) or 8 (the save
step after the ruinous update)."""

from __future__ import annotations

import json
import os
import signal
import types

import pytest
import torch
from dist_harness import SMALL_MULTI_RANK, TINY, run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training import trainer as trainer_mod
from megatron_snip.training.preemption import TrainingPreempted
from megatron_snip.training.trainer import Trainer, TrainingStopped

BASE = [*SMALL_MULTI_RANK, "training.log_interval=10", "training.save_interval=0", "training.max_steps=12"]


def _init(overrides: list[str]):
    cfg = load_config(TINY, overrides)
    return init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=300)


def _fit(tr: Trainer) -> str:
    try:
        tr.fit()
        return "finished"
    except (TrainingPreempted, TrainingStopped) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        tr.logger.close()


def _signal_after_step_worker(rank: int, world: int, overrides: list[str]) -> dict:
    """Rank 1 receives SIGTERM after step 0 has reduced its flags (between steps 0 and 1)."""
    tr = Trainer(load_config(TINY, overrides), _init(overrides))
    real = tr.train_step

    def step(s):
        res = real(s)
        if s == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return res

    tr.train_step = step
    return {"outcome": _fit(tr), "step": tr.step}


def test_a_signal_after_a_steps_flags_stops_every_rank_two_steps_later(tmp_path):
    over = BASE + [f"data.cache_dir={tmp_path / 'cache'}", f"training.run_dir={tmp_path / 'run'}"]
    res = run_ranks(_signal_after_step_worker, 2, args=(over,), timeout_s=600)  # dp=2
    # step 1's flags carry the signal; every rank reads them after step 2 (not at the log step 10)
    assert [r["step"] for r in res] == [3, 3], res
    assert "received SIGTERM; stopped after step 3: checkpoint" in res[1]["outcome"], res
    assert "received a stop signal (on another rank); stopped after step 3" in res[0]["outcome"], res
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [3]


def _preempt_and_resume_worker(rank: int, world: int, overrides: list[str], run_full: str, run_cut: str) -> dict:
    """An uninterrupted run; a run whose rank 1 receives SIGTERM during step 3's backward (before
    that step's flags are reduced); that run resumed to the end. PP=2: rank 1 is the last stage."""
    topo = _init(overrides)
    full = Trainer(load_config(TINY, overrides + [f"training.run_dir={run_full}"]), topo)
    assert _fit(full) == "finished"

    cut = Trainer(load_config(TINY, overrides + [f"training.run_dir={run_cut}"]), topo)
    real = cut.forward_backward

    def forward_backward(self, micro):
        loss = real(micro)
        if self.step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    cut.forward_backward = types.MethodType(forward_backward, cut)
    outcome, stopped_at = _fit(cut), cut.step

    resumed = Trainer(load_config(TINY, overrides + [f"training.run_dir={run_cut}", "training.resume=true"]), topo)
    resumed_from = resumed.step
    assert _fit(resumed) == "finished"
    full_sd, resumed_sd = full.model.state_dict(), resumed.model.state_dict()
    out = {"outcome": outcome, "step": stopped_at, "resumed_from": resumed_from,
           "weights_equal": full_sd.keys() == resumed_sd.keys()
           and all(torch.equal(full_sd[k], resumed_sd[k]) for k in full_sd)}
    if rank == 0:
        for name, run in (("full", run_full), ("cut", run_cut)):
            with open(f"{run}/metrics.jsonl") as f:
                rows = [json.loads(line) for line in f]
            out[name] = {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}
    return out


def test_a_signal_during_a_step_stops_every_rank_after_the_next_and_resumes_exactly(tmp_path):
    over = BASE + ["parallel.pp=2", f"data.cache_dir={tmp_path / 'cache'}"]
    res = run_ranks(_preempt_and_resume_worker, 2, args=(over, str(tmp_path / "full"), str(tmp_path / "cut")),
                    timeout_s=600)
    # step 3's flags carry the signal; every rank reads them after step 4 and saves there
    assert [r["step"] for r in res] == [5, 5], res
    assert "received SIGTERM; stopped after step 5" in res[1]["outcome"], res
    assert "TrainingPreempted: received a stop signal (on another rank); stopped after step 5" in res[0]["outcome"], res
    assert [r["resumed_from"] for r in res] == [5, 5]
    # the resumed run is the uninterrupted one, bit for bit (fp32 on CPU, same order of every sum)
    assert all(r["weights_equal"] for r in res), res
    assert res[0]["cut"] == res[0]["full"] and sorted(res[0]["full"]) == [10, 12], res[0]


def _ruinous_worker(rank: int, world: int, overrides: list[str]) -> dict:
    """Step 5 runs at lr=1e6 (a finite update that blows up the weights); checkpoints every 4 steps."""
    real = trainer_mod.lr_at
    trainer_mod.lr_at = lambda step, cfg: 1e6 if step == 5 else real(step, cfg)
    tr = Trainer(load_config(TINY, overrides), _init(overrides))
    outcome = _fit(tr)
    return {"outcome": outcome, "step": tr.step}


@pytest.mark.parametrize("layout", [["parallel.tp=2"], []], ids=["tp2", "dp2"])
def test_a_ruinous_update_stops_every_rank_before_the_next_checkpoint(tmp_path, layout):
    over = BASE + layout + ["training.save_interval=4", f"data.cache_dir={tmp_path / 'cache'}",
                            f"training.run_dir={tmp_path / 'run'}"]
    res = run_ranks(_ruinous_worker, 2, args=(over,), timeout_s=600)
    # step 5's refused flag is read after step 6, on every rank: the run stops at 7, before the
    # checkpoint of step 8 (which would hold weights built on the refused ones)
    assert [r["step"] for r in res] == [7, 7], res
    for r in res:
        assert r["outcome"].startswith("TrainingStopped: step 5: the optimizer update took the parameter norm"), r
        assert "the last checkpoint (step 4," in r["outcome"], r
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [4]


def _signal_during_eval_worker(rank: int, world: int, overrides: list[str]) -> dict:
    """Rank 1 receives SIGTERM in the first batch of the evaluation after step 4; rank 0 does not."""
    tr = Trainer(load_config(TINY, overrides), _init(overrides))
    real, batches = tr.evaluate_batch, []

    def evaluate_batch(tokens):
        batches.append(tr.step)
        if rank == 1 and len(batches) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(tokens)

    tr.evaluate_batch = evaluate_batch
    return {"outcome": _fit(tr), "step": tr.step, "eval_batches": len(batches)}


def test_a_signal_on_one_rank_during_an_evaluation_aborts_it_on_every_rank_and_saves_there(tmp_path):
    # issue #36 item 3: the ranks agree between evaluation batches (one flag all-reduce each), so the
    # evaluation stops after its first batch everywhere and the checkpoint of step 4 comes first -
    # on the code that finished the evaluation, the run stopped a step or two later (steps 5-6)
    over = BASE + [f"data.cache_dir={tmp_path / 'cache'}", f"training.run_dir={tmp_path / 'run'}",
                   "training.eval_interval=4", "training.eval_batches=3"]
    res = run_ranks(_signal_during_eval_worker, 2, args=(over,), timeout_s=600)
    assert [r["step"] for r in res] == [4, 4] and [r["eval_batches"] for r in res] == [1, 1], res
    assert "received SIGTERM; stopped after step 4: checkpoint" in res[1]["outcome"], res
    assert "its evaluation was aborted (the signal came during it) to save first" in res[0]["outcome"], res
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [4]
