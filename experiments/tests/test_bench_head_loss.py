"""experiments/bench/head_loss.py runs at tiny's tail, and its three variants compute the same loss
and gradients (the timing itself is the benchmark's, not a test's)."""

from __future__ import annotations

import torch

from experiments.bench import head_loss


def test_head_loss_bench_runs_and_its_variants_agree():
    rows = {k: diffs for k, (_, _, diffs) in head_loss.bench("tiny", torch.float32, rounds=1, warmup=1).items()}
    assert sorted(rows) == ["eager", "head+loss", "loss"], rows
    # Worst-case reduction-order bounds n·u·Σ|terms| (u = 2^-24): the loss sums V = 320 exponentials
    # and averages T = 2048 log-sum-exps of ~6 nats, (T + V)·u·6 ≈ 1e-3; dW sums T products with
    # |g| ≤ 1/T and |h| ≤ ~5, T·u·5/T·T ≈ 6e-4; dh sums V products, far less. A wrong variant (another
    # target, a dropped mean) moves the loss by O(1).
    for name, (d_loss, d_dh, d_dw) in rows.items():
        assert d_loss <= 1e-3 and d_dh <= 1e-3 and d_dw <= 1e-3, (name, d_loss, d_dh, d_dw)
