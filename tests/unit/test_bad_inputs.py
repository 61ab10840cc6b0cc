"""Bad or hostile inputs each end in one clear message naming the field or file, the value and
the fix - never a traceback, a hang or a silently wrong result (issue #17, items 5-10)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_snip import train as train_cli
from megatron_snip.config import load_config
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.trainer import Trainer, TrainingStopped

TINY = "launch/configs/tiny.toml"


# --- item 5: non-finite config values --------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("training.lr=inf", "training.lr"),
    ("training.weight_decay=nan", "training.weight_decay"),
    ("training.grad_clip=nan", "training.grad_clip"),
    ("training.min_lr=nan", "training.min_lr"),
    ("model.rope_base=nan", "model.rope_base"),
    ("model.norm_eps=inf", "model.norm_eps"),
    ("training.adam_eps=inf", "training.adam_eps"),
    ("model.init_std=1e20", "model.init_std"),
    ("snip.weight_divergence_weight=nan", "snip.weight_divergence_weight"),
    ("snip.solver_max_time=nan", "snip.solver_max_time"),
])
def test_non_finite_config_values_are_refused(override, field):
    with pytest.raises(ValueError, match=rf"config {field}=.*(finite|must be in \(0, 1\])"):
        load_config(TINY, [override])


# --- item 6: a finite but ruinous update -------------------------------------------------------
def test_huge_update_stops_before_the_weights_are_saved(small_overrides, tmp_path, capsys):
    over = small_overrides + ["training.max_steps=6", "training.save_interval=2", "training.lr=1e6",
                              "training.min_lr=0", "training.warmup_steps=0"]
    code = train_cli.main(["--config", TINY, *sum((["--set", o] for o in over), [])])
    err = capsys.readouterr().err
    assert code == train_cli.EXIT_STOPPED
    assert "error: training stopped: step 0: the optimizer update took the parameter norm from" in err
    assert "stopped before these weights were saved - no checkpoint (none was saved yet)" in err
    assert "Lower training.lr (now 1000000.0)" in err and "Traceback" not in err
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_update_guard_names_the_last_good_checkpoint(small_overrides, tmp_path, monkeypatch):
    tr = Trainer(load_config(TINY, small_overrides + ["training.max_steps=4", "training.save_interval=2"]))
    for _ in range(2):
        tr.train_step(tr.step)
        tr.step += 1
    tr.save()
    good = {k: v.clone() for k, v in tr.model.state_dict().items()}
    monkeypatch.setattr("megatron_snip.training.trainer.lr_at", lambda step, cfg: 1e6)
    with pytest.raises(TrainingStopped, match=r"step 2: .* the last checkpoint \(step 2, .*step_000002\) holds good"):
        tr.fit()
    tr.logger.close()
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [2]
    state = ckpt.read_shard(tmp_path / "run" / "checkpoints", 2)
    assert all(torch.equal(good[k], state["model"][k]) for k in good)
    assert max(float(p.detach().abs().max()) for p in tr.model.parameters()) > 1e3  # the bad update happened in memory


def test_consecutive_non_finite_steps_exit_non_zero_with_a_message(small_overrides, capsys, monkeypatch):
    real = Trainer.forward_loss
    monkeypatch.setattr(Trainer, "forward_loss", lambda self, tokens: real(self, tokens) * float("nan"))
    over = small_overrides + ["training.max_steps=6", "training.max_consecutive_skips=2"]
    code = train_cli.main(["--config", TINY, *sum((["--set", o] for o in over), [])])
    err = capsys.readouterr().err
    assert code == train_cli.EXIT_STOPPED
    assert "error: training stopped: 2 consecutive non-finite steps (training.max_consecutive_skips=2)" in err
    assert "Traceback" not in err


# --- item 7: non-finite SNIP statistics --------------------------------------------------------
def test_non_finite_snip_statistics_keep_the_previous_plan(small_overrides, monkeypatch, capsys):
    from megatron_snip.snip import controller as ctl
    from megatron_snip.training.run import run_training

    real = ctl.policy_costs

    def poisoned(*args, **kwargs):
        costs = real(*args, **kwargs)
        first = next(iter(costs))
        costs[first] = {f: math.nan for f in costs[first]}
        return costs

    monkeypatch.setattr(ctl, "policy_costs", poisoned)
    cfg = load_config(TINY, small_overrides + ["training.max_steps=3", "snip.enabled=true", "snip.warmup=1",
                                               "snip.interval=100", "snip.fp4_target=0.5"])
    final = run_training(cfg)
    out = capsys.readouterr().out
    assert "re-plan at step 1: starting" in out
    assert "re-plan at step 1: non-finite SNIP statistics for 1 GEMM(s), e.g. ['0.qkv.fprop']; keeping the previous plan" in out
    assert math.isfinite(final["val_loss"])
