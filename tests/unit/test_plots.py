"""Precision-plan figures are written, non-empty PNGs; bad input gives clear errors."""

from __future__ import annotations

import math

import pytest

from megatron_snip.precision.plan import GemmId, PrecisionPlan, all_gemm_ids
from megatron_snip.telemetry import plots

NUMEL = {"qkv": 3, "proj": 2, "fc1": 5, "fc2": 4}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def mixed_plan(num_layers: int, step: int = 0, shift: int = 0) -> PrecisionPlan:
    cycle = ("fp8", "nvfp4", "nvfp4", "bf16", "mxfp4")
    entries = {g: cycle[(i + shift) % len(cycle)] for i, g in enumerate(all_gemm_ids(num_layers))}
    return PrecisionPlan.create(entries, NUMEL, step=step, policy="snip", objective=1.5, solver_status="OPTIMAL",
                                extra={"fp4_target": 0.5})


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


@pytest.mark.parametrize("num_layers", [4, 80])
def test_precision_map_written(tmp_path, num_layers):
    out = plots.plot_precision_map(mixed_plan(num_layers, step=300), tmp_path / "sub" / "map.png", title="t")
    assert out == tmp_path / "sub" / "map.png"
    assert_png(out)


def test_precision_map_partial_plan(tmp_path):
    """A plan covering only some GEMMs (e.g. one pipeline stage) still plots; gaps are blank."""
    entries = {GemmId(layer, "fc2", "wgrad"): "nvfp4" for layer in (2, 3)}
    assert_png(plots.plot_precision_map(PrecisionPlan.create(entries, NUMEL), tmp_path / "p.png"))


def test_precision_map_rejects_empty_plan(tmp_path):
    with pytest.raises(ValueError, match="has no entries"):
        plots.plot_precision_map(PrecisionPlan.create({}, NUMEL), tmp_path / "x.png")


@pytest.mark.parametrize("num_layers", [4, 80])
def test_timeline_written(tmp_path, num_layers):
    plans = [mixed_plan(num_layers, step=s, shift=k) for k, s in enumerate((500, 0, 250))]  # unsorted on purpose
    assert_png(plots.plot_timeline(plans, tmp_path / "timeline.png"))


def test_timeline_single_plan(tmp_path):
    assert_png(plots.plot_timeline([mixed_plan(2, step=0)], tmp_path / "one.png"))


def test_timeline_rejects_empty_list(tmp_path):
    with pytest.raises(ValueError, match="plot_timeline needs at least one plan; got an empty list"):
        plots.plot_timeline([], tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_pareto(tmp_path):
    pts = [(0.0, 1.0), (0.5, 2.0), (0.75, 4.5), (1.0, math.inf)]
    assert_png(plots.plot_pareto(pts, tmp_path / "pareto.png"))
    with pytest.raises(ValueError, match="at least one"):
        plots.plot_pareto([], tmp_path / "e.png")
    with pytest.raises(ValueError, match="every target is infeasible"):
        plots.plot_pareto([(0.9, math.inf)], tmp_path / "e.png")
