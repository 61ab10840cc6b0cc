"""No host sync per step (issue #24 item 3): the step's guards decide on the device and the loop
reads the outcomes once per read step; skips, stops and logged values stay as they were."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_snip.config import load_config
from megatron_snip.telemetry.host_syncs import count_host_syncs
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training import trainer as trainer_mod
from megatron_snip.training.step_guard import (
    LaggedFlags,
    LateFlags,
    StepResult,
    optimizer_step,
    takes_found_inf,
    update_refused,
)
from megatron_snip.training.trainer import Trainer, TrainingStopped

TINY = "launch/configs/tiny.toml"


def _fused_on_cpu(monkeypatch):
    """Build torch's fused AdamW on CPU too: the CUDA path, whose kernel skips on a device flag."""
    real = trainer_mod.build_optimizer

    def fused(model, cfg, device, topo):
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                  for g in real(model, cfg, device, topo).param_groups]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=True)

    monkeypatch.setattr(trainer_mod, "build_optimizer", fused)


def _syncs_per_step(tr: Trainer, monkeypatch) -> tuple[list[int], list[int]]:
    """Run ``tr.fit()`` counting megatron_snip's host reads: inside each ``train_step`` and in the
    loop's work after it (up to the next step's start), per step."""
    inside, after, marks = [], [], []
    real = Trainer.train_step

    with count_host_syncs() as syncs:
        def step(self, s):
            if marks:
                after.append(syncs.count - marks[-1])
            n = syncs.count
            res = real(self, s)
            inside.append(syncs.count - n)
            marks.append(syncs.count)
            return res

        monkeypatch.setattr(Trainer, "train_step", step)
        tr.fit()
        after.append(syncs.count - marks[-1])
    tr.logger.close()
    return inside, after


def test_no_host_sync_between_log_steps_with_a_device_skip(small_overrides, monkeypatch):
    """With an optimizer that skips on the device, a step reads nothing on the host; the loop
    reads once at each log step (one ``tolist`` of every step since the last) and at the end."""
    _fused_on_cpu(monkeypatch)
    cfg = load_config(TINY, small_overrides + ["training.max_steps=8", "training.log_interval=4",
                                              "training.eval_interval=100", "training.save_interval=0"])
    tr = Trainer(cfg)
    assert takes_found_inf(tr.optimizer)
    inside, after = _syncs_per_step(tr, monkeypatch)
    assert inside == [0] * 8
    reads = [i for i, n in enumerate(after) if n]  # 0-based steps whose loop body read something
    assert reads == [3, 7], after  # log steps 4 and 8 (step 8 also evaluates and saves)
    assert after[3] == 1


def test_one_read_per_step_when_the_optimizer_cannot_skip_on_the_device(small_overrides, monkeypatch):
    """The CPU default (foreach AdamW) has no ``found_inf``: its skip decision is the one read a step makes."""
    cfg = load_config(TINY, small_overrides + ["training.max_steps=4", "training.log_interval=4",
                                              "training.eval_interval=100", "training.save_interval=0"])
    tr = Trainer(cfg)
    assert not takes_found_inf(tr.optimizer)
    inside, after = _syncs_per_step(tr, monkeypatch)
    assert inside == [1] * 4 and after[:3] == [0, 0, 0]


def test_device_skip_leaves_weights_moments_and_step_count(small_overrides, monkeypatch):
    _fused_on_cpu(monkeypatch)
    tr = Trainer(load_config(TINY, small_overrides + ["training.max_steps=6"]))
    assert not tr.train_step(0).skipped
    params = [p.detach().clone() for p in tr.model.parameters()]
    state = {k: v.clone() for k, v in tr.optimizer.state[next(tr.model.parameters())].items()}
    real_loss = tr.model.loss
    tr.model.loss = lambda logits, targets: real_loss(logits, targets) * float("nan")
    res = tr.train_step(1)
    assert res.skipped and math.isnan(res.loss) and not bool(res.bad_update_t)
    assert all(torch.equal(a, b) for a, b in zip(params, tr.model.parameters()))
    after = tr.optimizer.state[next(tr.model.parameters())]
    assert all(torch.equal(state[k], after[k]) for k in state)  # includes "step": not advanced
    tr.logger.close()


def test_skipped_steps_are_logged_as_their_own_steps_at_the_next_read(small_overrides, tmp_path, monkeypatch):
    """A NaN at step 2 (not a log step) still gets its text line and its metrics line at step 3,
    with the fields a skipped step always had; the run goes on and the counts are right."""
    real = Trainer._stage_forward

    def nan_at_step_2(self, tokens, x):
        out = real(self, tokens, x)
        return out * float("nan") if self.step == 2 else out

    monkeypatch.setattr(Trainer, "_stage_forward", nan_at_step_2)
    tr = Trainer(load_config(TINY, small_overrides + ["training.max_steps=8", "training.log_interval=4",
                                                     "training.eval_interval=100"]))
    tr.fit()
    tr.logger.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(by_step) == [3, 4, 8]
    assert math.isnan(float(by_step[3]["loss"])) and by_step[3]["skipped_steps"] == 1
    assert {"lr", "grad_norm", "step_time_s", "tokens_per_s", "fp4_share"} <= by_step[3].keys()
    assert by_step[4]["skipped_steps"] == 1 and math.isfinite(by_step[4]["loss"])
    assert tr.skipped_steps == 1 and tr.consecutive_skips == 0


def test_consecutive_skips_stop_with_the_count_and_step(small_overrides, monkeypatch):
    real = Trainer._stage_forward
    monkeypatch.setattr(Trainer, "_stage_forward", lambda self, tokens, x: real(self, tokens, x) * float("nan"))
    tr = Trainer(load_config(TINY, small_overrides + ["training.max_steps=10", "training.log_interval=5",
                                                     "training.max_consecutive_skips=3"]))
    with pytest.raises(TrainingStopped, match=r"3 consecutive non-finite steps .* at step 2;"):
        tr.fit()
    assert tr.skipped_steps == 3
    tr.logger.close()


@pytest.mark.parametrize("before, after, skipped, growth, refused", [
    (10.0, 20.0, 0.0, 2.0, False),          # exactly the limit: allowed (host rule: after <= growth * before)
    (10.0, 20.000002, 0.0, 2.0, True),      # just past it
    (10.0, float("nan"), 0.0, 2.0, True),
    (10.0, float("inf"), 0.0, 0.0, True),   # no growth limit, still non-finite
    (10.0, 1e9, 0.0, 0.0, False),           # no growth limit
    (10.0, float("nan"), 1.0, 2.0, False),  # a skipped step changed nothing
])
def test_update_refused_matches_the_host_rule(before, after, skipped, growth, refused):
    got = update_refused(torch.tensor(before), torch.tensor(after), torch.tensor(skipped), growth)
    assert got.dtype == torch.float32 and got.shape == () and bool(got) is refused


def test_host_skip_path_zeroes_grads_and_does_not_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1.0, foreach=True)
    p.grad = torch.ones(3)
    optimizer_step(opt, torch.tensor(1.0))
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None and not opt.state
    p.grad = torch.ones(3)
    optimizer_step(opt, torch.tensor(0.0))
    assert not torch.equal(p.detach(), torch.ones(3))


def test_zero1_on_the_fused_kernel_skips_on_the_device(small_overrides):
    """The distributed optimizer on torch's fused kernel (its CUDA path; the kernel runs on CPU too)
    takes the skip flag as found_inf: no host read, shards, moments and step counts untouched."""
    tr = Trainer(load_config(TINY, small_overrides + ["training.distributed_optimizer=true", "training.max_steps=4"]))
    tr.optimizer.fused = True  # before its first step: the state is created for the fused kernel
    assert takes_found_inf(tr.optimizer)
    assert not tr.train_step(0).skipped
    params = [p.detach().clone() for p in tr.model.parameters()]
    state = [{k: v.clone() for k, v in st.items()} for st in tr.optimizer.shard_state]
    real_loss = tr.model.loss
    tr.model.loss = lambda logits, targets: real_loss(logits, targets) * float("nan")
    with count_host_syncs() as syncs:
        res = tr.train_step(1)
    assert syncs.count == 0, syncs.where
    assert res.skipped
    assert all(torch.equal(a, b) for a, b in zip(params, tr.model.parameters()))
    assert all(torch.equal(st[k], now[k]) for st, now in zip(state, tr.optimizer.shard_state) for k in st)
    tr.logger.close()


# --- the stop and guard flags, on the host one step later (LaggedFlags) ---------------------------
def _result(step: int, stop: bool, refused: bool) -> StepResult:
    zero = torch.tensor(0.0)
    return StepResult(step, zero, zero, zero, torch.tensor(float(stop)), zero, zero, torch.tensor(float(refused)))


class _ModelledStream(LaggedFlags):
    """``LaggedFlags`` over a model of its CUDA path: a copy launched on the stream lands at some
    time between its launch and the completion of the event recorded after it, in stream order -
    here either at once (``eager``) or only when that event is waited on."""

    def __init__(self, eager: bool) -> None:
        super().__init__(torch.device("cpu"))
        self.eager, self.queued = eager, []  # launched copies not landed yet: (buffer index, values)

    def _start_copy(self, slot, flags):
        self.queued.append((slot, flags.clone()))
        if self.eager:
            self._land(len(self.queued))

    def _wait(self, slot):  # its event follows the newest copy into ``slot``
        launched = [i for i, (s, _) in enumerate(self.queued) if s == slot]
        self._land(launched[-1] + 1 if launched else 0)

    def _land(self, n):
        for slot, values in self.queued[:n]:
            self._buffers[slot].copy_(values)
        del self.queued[:n]


@pytest.mark.parametrize("make", [lambda: LaggedFlags(torch.device("cpu")), lambda: _ModelledStream(eager=True),
                                  lambda: _ModelledStream(eager=False)], ids=["cpu", "copy_lands_at_once", "lands_at_wait"])
def test_lagged_flags_hand_back_the_step_before(make):
    """Each exchange returns the previous step's flags, whenever the asynchronous copies land: the
    read waits for its own copy, and the next step's copy goes to the other buffer."""
    flags = make()
    pattern = [(False, False), (True, False), (False, True), (True, True), (False, False)]
    got = [flags.exchange(_result(s, *f)) for s, f in enumerate(pattern)]
    assert got == [None] + [LateFlags(s, *f) for s, f in enumerate(pattern[:-1])]


def test_lagged_flags_are_not_device_reads():
    flags = LaggedFlags(torch.device("cpu"))
    with count_host_syncs() as syncs:
        for s in range(3):
            flags.exchange(_result(s, True, False))
    assert syncs.count == 0, syncs.where


def test_a_ruinous_update_stops_after_the_next_step_not_at_the_next_read(small_overrides, tmp_path, monkeypatch):
    """Step 5's update is refused; its flag reaches the host after step 6 and the read there
    raises, before the save of step 8 (log steps every 10: the run used to stop at 8)."""
    real = trainer_mod.lr_at
    monkeypatch.setattr(trainer_mod, "lr_at", lambda step, cfg: 1e6 if step == 5 else real(step, cfg))
    tr = Trainer(load_config(TINY, small_overrides + ["training.max_steps=12", "training.log_interval=10",
                                                     "training.save_interval=4", "training.eval_interval=100"]))
    with pytest.raises(TrainingStopped, match=r"^step 5: .* the last checkpoint \(step 4, "):
        tr.fit()
    tr.logger.close()
    assert tr.step == 7
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [4]
