"""SNIP with the Transformer Engine backend: statistics, plan and apply on CUDA (needs CUDA +
transformer_engine; skipped elsewhere, e.g. every CPU CI run).

What it guards: the statistics pass runs its probe GEMMs through ``te.Linear`` in BF16,
measures the format errors with the emulated reference (TE cannot run GEMMs on a detached
weight), and takes the rerun path for the propagation gains (``te.Linear`` allows one backward
per graph); the plan is applied at a step boundary and training goes on with finite losses.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_snip.config import load_config
from megatron_snip.precision.backends.support import check
from megatron_snip.snip.controller import SnipController
from megatron_snip.training.trainer import Trainer

pytestmark = pytest.mark.skipif(
    not check("te", "fp8", "cuda"),
    reason=f"needs CUDA, transformer_engine and an FP8 GPU: {check('te', 'fp8', 'cuda').reason}",
)


# SNIP's candidates and FP4 target: NVFP4 needs Blackwell; on Hopper the candidates are BF16 and
# FP8 and there is no FP4 target. tests/unit/test_gpu_shapes.py runs both settings through the
# te backend's start-up rules (``te.setting_problems``) and the model's shapes through the block rules.
CANDIDATES = {"blackwell": (["fp8", "nvfp4"], 0.5), "hopper": (["bf16", "fp8"], 0.0)}


def overrides(formats: list[str], rho: float, tmp_path) -> list[str]:
    """The run's config overrides on launch/configs/tiny.toml."""
    return [
        "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "training.seq_len=64", "training.micro_batch_size=4", "training.global_batch_size=4",
        "training.warmup_steps=1", "training.eval_batches=1", "training.eval_interval=1000", "training.max_steps=4",
        "training.progress=false", "training.device=cuda", "data.valid_paths=[]", "precision.backend=te",
        "snip.granularity=layer",  # TE runs one recipe per linear
        "snip.enabled=true", "snip.policy=snip", f"snip.formats={json.dumps(formats)}", f"snip.fp4_target={rho}",
        "snip.warmup=1", "snip.interval=2", "snip.probe_batches=1", "snip.noise_draws=1",
        f"training.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
    ]


def test_snip_replans_with_the_te_backend(tmp_path):
    formats, rho = CANDIDATES["blackwell" if check("te", "nvfp4", "cuda") else "hopper"]
    cfg = load_config("launch/configs/tiny.toml", overrides(formats, rho, tmp_path))
    tr = Trainer(cfg)
    tr.fit([SnipController(cfg, tr)])
    tr.logger.close()
    assert len(tr.plan_history) == 3  # the initial bf16 plan + re-plans at steps 1 and 3
    snap = json.loads((tmp_path / "run" / "plans" / "step_000003_stats.json").read_text())
    for key, s in snap["linears"].items():
        assert s["per_format"]["fp8"]["sq_ey"] > 0 and math.isfinite(s["curv_num"]), key
    assert sum(p["num"] for p in snap["propagation"].values()) > 0
    losses = [json.loads(line).get("loss") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for v in losses if v is not None)
