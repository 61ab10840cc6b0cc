"""Resume at a new layout, on gloo: a TP=1 checkpoint resumed straight at TP=2 x PP=2 logs the
losses of the same checkpoint converted with scripts/reshard_checkpoint.py first, bit for bit (both
load the same shards into the same layout); and ``megatron_snip.evaluate`` at TP=2 gives the
single-process loss up to the TP partial-sum order (1e-6 relative, as tests/distributed/
test_hf_parallel.py derives for these shapes)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dist_harness import SMALL_MULTI_RANK, TINY, run_ranks

from megatron_snip.config import load_config
from megatron_snip.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import reshard_checkpoint

BASE = SMALL_MULTI_RANK


def _resume_worker(rank: int, world: int, overrides: list[str], steps: int) -> list[float]:
    """Resume the run in ``overrides`` at its layout and train to ``steps``; the losses of the steps run here."""
    from megatron_snip.parallel.distributed import destroy_distributed, init_distributed

    cfg = load_config(TINY, [*overrides, f"training.max_steps={steps}", "training.resume=auto"])
    topo = init_distributed(cfg.parallel.tp, cfg.parallel.pp, device_type="cpu", timeout_s=90) if world > 1 else None
    tr = Trainer(cfg, topo)
    start, losses = tr.step, []
    while tr.step < steps:
        losses.append(tr.train_step(tr.step).loss)
        tr.step += 1
    tr.logger.close()
    destroy_distributed()
    return [start, *losses]


def _eval_worker(rank: int, world: int, argv: list[str]) -> dict:
    from megatron_snip import evaluate
    from megatron_snip.parallel.distributed import destroy_distributed

    try:
        return evaluate.run(evaluate.parse_args(argv), evaluate.topo_for)
    finally:
        destroy_distributed()


def test_tp1_checkpoint_resumed_at_tp2_pp2_matches_the_converted_one(tmp_path):
    base = BASE + [f"data.cache_dir={tmp_path / 'cache'}"]
    tr = Trainer(load_config(TINY, [*base, f"training.run_dir={tmp_path / 'a'}", "training.max_steps=3"]))
    tr.fit()
    tr.logger.close()
    shutil.copytree(tmp_path / "a", tmp_path / "converted")
    assert reshard_checkpoint.main([str(tmp_path / "converted"), "--tp", "2", "--pp", "2"]) == 0
    layout = ["parallel.tp=2", "parallel.pp=2"]
    direct = run_ranks(_resume_worker, 4, args=([*base, *layout, f"training.run_dir={tmp_path / 'a'}"], 5), timeout_s=180)
    converted = run_ranks(_resume_worker, 4, args=([*base, *layout, f"training.run_dir={tmp_path / 'converted'}"], 5),
                          timeout_s=180)
    assert direct[0][0] == 3 and len(direct[0]) == 3  # resumed at step 3, ran steps 3 and 4
    assert direct == converted, (direct, converted)

    argv = ["--checkpoint", str(tmp_path / "a"), "--no-held-out", "--valid-corpus", "moby=bundled:moby_dick",
            "--max-sequences", "8"]
    one = _eval_worker(0, 1, argv)["domains"]["moby"]["loss"]
    two = run_ranks(_eval_worker, 2, args=([*argv, "--set", "parallel.tp=2"],), timeout_s=120)
    assert two[0]["layout"].startswith("world=2 tp=2")
    for r in two:
        got = r["domains"]["moby"]["loss"]
        assert abs(got - one) <= 1e-6 * abs(one), (got, one)
