"""experiments/bench/memory.py runs (small model, no DP part) and its targets hold there."""

from __future__ import annotations

from experiments.bench import memory


def test_memory_bench_runs_and_meets_its_targets(capsys):
    assert memory.main(["--small", "--skip-dp"]) == 0
    out = capsys.readouterr().out
    for name in memory.SETTINGS:
        assert name in out, name
    assert "MISSED" not in out and out.count(" ok") == len(memory.TARGETS) + 2  # two full-recompute rows
    assert "full      dist_opt on     128   2" in out  # the 70B dry-run table

