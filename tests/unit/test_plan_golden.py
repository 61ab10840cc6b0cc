"""FP4-share plans and hashes do not change (issue #23: the GEMM-time target and the ILP split
must leave today's plans bit-identical).

Two checks: the golden plans of ``plan_golden.py`` (static and ILP policies, written before the
change), and a replay of the static plans recorded in the committed comparison
(``docs/results/comparison/results.jsonl``): each record's config rebuilt into a plan gives the FP4 share
the run logged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_snip.config import config_from_dict
from megatron_snip.model import shapes as model_shapes
from megatron_snip.snip.policies import PlanContext, make_plan
from tests.unit import plan_golden

RECORDS = Path(__file__).parents[2] / "docs" / "results" / "comparison" / "results.jsonl"


def test_golden_fp4_share_plans_unchanged():
    expected = json.loads(plan_golden.GOLDEN.read_text())
    got = plan_golden.compute()
    assert set(got) == set(expected)
    changed = [name for name in expected if got[name] != expected[name]]
    assert not changed, f"{len(changed)} plans changed, e.g. {changed[:3]}: {got[changed[0]]} != {expected[changed[0]]}"


def _static_records():
    for line in RECORDS.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("status") == "ok" and rec["policy"] in ("bf16_ends", "layer_type", "random"):
            yield rec


@pytest.mark.parametrize("rec", list(_static_records()), ids=lambda r: r["name"])
def test_recorded_static_plans_replay(rec):
    raw = {k: v for k, v in rec["config"].items()}
    cfg = config_from_dict(raw)
    numel = model_shapes.linear_numel(model_shapes.model_linear_shapes(cfg.model))
    ctx = PlanContext.for_run(cfg.snip, cfg.model.num_layers, numel, cfg.parallel.pp)
    plan = make_plan(cfg.snip.policy, ctx)
    assert plan.fp4_flops_share == rec["fp4_share"]
