"""logging.tensorboard: the event files hold W&B's scalars (each metrics record's, each plan's) at
their steps and the precision maps as the very PNG files; read back with tensorboard's
EventAccumulator. A missing package is a clear error; off means no files."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from megatron_snip.config import load_config
from megatron_snip.telemetry.sinks import Sinks
from megatron_snip.telemetry.tensorboard_sink import TensorBoardSink, png_header
from megatron_snip.telemetry.wandb_sink import plan_scalars, scalars
from megatron_snip.training.run import run_training

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TINY = "launch/configs/tiny.toml"
SNIP = ["snip.enabled=true", "snip.policy=uniform:fp8", "snip.fp4_target=0", "snip.warmup=2", "snip.interval=2",
        "snip.probe_batches=1", "snip.noise_draws=1"]


def _events(run):
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_event_files_hold_the_wandb_scalars_and_the_maps(small_overrides, tmp_path):
    cfg = load_config(TINY, small_overrides + SNIP + ["training.max_steps=4", "training.log_interval=1",
                                                      "training.eval_interval=2", "logging.tensorboard=true"])
    run_training(cfg)
    run = tmp_path / "run"
    acc = _events(run)
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    want: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in scalars(r).items():
            want.setdefault(k, {})[r["step"]] = v
    from megatron_snip.precision.plan import PrecisionPlan

    plans = sorted((run / "plans").glob("step_??????.json"))
    for p in plans[1:]:  # the re-plans (the initial plan is recorded before any sink sees a step)
        plan = PrecisionPlan.load(p)
        for k, v in plan_scalars(plan).items():
            want.setdefault(k, {})[plan.step] = v
    assert {"loss", "lr", "grad_norm", "val_loss", "plan/fp4_flops_share", "plan/count/fp8"} <= want.keys()
    for tag, series in want.items():
        assert tag in got, tag
        # TensorBoard stores scalars as float32
        assert got[tag] == {s: float(np.float32(v)) for s, v in series.items()}, tag
    # Images: each re-plan's map and the final map / timeline, byte for byte the PNGs in the run directory.
    images = acc.Tags()["images"]
    assert {"plan/map", "final/map", "plan/timeline"} <= set(images)
    maps = {e.step: e.encoded_image_string for e in acc.Images("plan/map")}
    assert sorted(maps) == [int(p.stem[5:]) for p in plans[1:]] == [2] and all(maps[s] == (run / "plans" / f"step_{s:06d}.png").read_bytes() for s in maps)
    (final,) = acc.Images("final/map")
    assert final.encoded_image_string == (run / "precision_map.png").read_bytes() and final.step == 4
    width, height, _ = png_header(final.encoded_image_string, "final")
    assert (final.width, final.height) == (width, height)


def test_missing_package_is_a_config_error(small_overrides, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = load_config(TINY, small_overrides + ["logging.tensorboard=true"])
    with pytest.raises(ValueError, match=r"logging.tensorboard=true needs the tensorboard package: pip install"):
        Sinks.from_config(cfg, "unused", is_writer=True)


def test_off_or_not_the_writer_means_no_sink(small_overrides, tmp_path):
    cfg = load_config(TINY, small_overrides)
    assert Sinks.from_config(cfg, tmp_path, is_writer=True) is None
    on = load_config(TINY, small_overrides + ["logging.tensorboard=true"])
    assert TensorBoardSink.from_config(on, tmp_path, is_writer=False) is None
    assert not (tmp_path / "tensorboard").exists()


def test_not_a_png_is_refused(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"GIF89a" + bytes(40))
    with pytest.raises(ValueError, match="is not a PNG file"):
        png_header(bad.read_bytes(), bad)
