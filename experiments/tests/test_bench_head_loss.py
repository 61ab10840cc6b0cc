"""experiments/bench/head_loss.py runs at tiny's tail, and its three variants compute the same loss
and gradients (the timing itself is the benchmark's, not a test's)."""

from __future__ import annotations

import re

from experiments.bench import head_loss


def test_head_loss_bench_runs_and_its_variants_agree(capsys):
    head_loss.main(["--shapes", "tiny", "--rounds", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    rows = {m[0]: [float(x) for x in m[1:]] for m in re.findall(
        r"^\s+(eager|loss|head\+loss)\s+\S+ s\s+x\S+\s+(\S+)\s+(\S+)\s+(\S+)$", out, flags=re.MULTILINE)}
    assert sorted(rows) == ["eager", "head+loss", "loss"], out
    # Worst-case reduction-order bounds n·u·Σ|terms| (u = 2^-24): the loss sums V = 320 exponentials
    # and averages T = 2048 log-sum-exps of ~6 nats, (T + V)·u·6 ≈ 1e-3; dW sums T products with
    # |g| ≤ 1/T and |h| ≤ ~5, T·u·5/T·T ≈ 6e-4; dh sums V products, far less. A wrong variant (another
    # target, a dropped mean) moves the loss by O(1).
    for name, (d_loss, d_dh, d_dw) in rows.items():
        assert d_loss <= 1e-3 and d_dh <= 1e-3 and d_dw <= 1e-3, (name, d_loss, d_dh, d_dw)
