"""A stop signal on one rank of a distributed run (issue #24 item 3): the flag travels in each
step's skip-flag all-reduce and is read at the next read step (here the next log step), where
every rank saves the same checkpoint and raises ``TrainingPreempted``."""

from __future__ import annotations

import os
import signal

from dist_harness import SMALL_MULTI_RANK, TINY, run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.training import checkpoint as ckpt
from megatron_snip.training.preemption import TrainingPreempted
from megatron_snip.training.trainer import Trainer

BASE = [*SMALL_MULTI_RANK, "training.log_interval=3", "training.save_interval=0", "training.max_steps=9"]


def _worker(rank: int, world: int, overrides: list[str]) -> dict:
    cfg = load_config(TINY, overrides)
    topo = init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=300)
    tr = Trainer(cfg, topo)
    real = Trainer.train_step

    def step(self, s):
        res = real(self, s)
        if s == 0 and self.topo.rank == 1:  # only rank 1 is told to stop, after step 0
            os.kill(os.getpid(), signal.SIGTERM)
        return res

    Trainer.train_step = step
    try:
        tr.fit()
        outcome = "finished"
    except TrainingPreempted as e:
        outcome = str(e)
    tr.logger.close()
    return {"outcome": outcome, "step": tr.step}


def test_a_signal_on_one_rank_stops_every_rank_at_the_next_read_step(tmp_path):
    over = BASE + [f"data.cache_dir={tmp_path / 'cache'}", f"training.run_dir={tmp_path / 'run'}"]
    res = run_ranks(_worker, 2, args=(over,), timeout_s=600)  # dp=2
    # step 1's flags (sampled after rank 1's signal) are read at the log step 3 on both ranks
    assert [r["step"] for r in res] == [3, 3], res
    assert "received SIGTERM during step 2" in res[1]["outcome"], res
    assert "a stop signal (on another rank) during step 2" in res[0]["outcome"], res
    assert ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints") == 3
