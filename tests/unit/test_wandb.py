"""Observability without a network: the W&B sink (an offline run read back with W&B's own
transaction-log reader, ``wandb leet inspect --json``) and scripts/plot_run.py."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_snip.config import load_config
from megatron_snip.precision.plan import GemmId, PrecisionPlan, all_gemm_ids
from megatron_snip.telemetry.logger import RunLogger
from megatron_snip.telemetry.wandb_sink import WandbSink, base_url, login_key, resolve_mode, scalars

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUMEL = {"qkv": 3, "proj": 2, "fc1": 5, "fc2": 4}
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")


def test_mode_resolution():
    assert resolve_mode("auto", {}) == "offline"
    assert resolve_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert resolve_mode("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_mode("auto", {"WANDB_MODE": "dryrun"}) == "offline"
    assert resolve_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"
    with pytest.raises(ValueError, match="logging.wandb_mode"):
        resolve_mode("cloud", {})


def test_auto_mode_honours_wandb_login(tmp_path):
    """`wandb login` stores the key in ~/.netrc (not WANDB_API_KEY): auto must go online with it,
    for the host `wandb login --host` saved in the user's W&B settings."""
    home = tmp_path / "home"
    (home / ".config" / "wandb").mkdir(parents=True)
    env = {"HOME": str(home)}
    assert resolve_mode("auto", env) == "offline"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k123\n")
    assert resolve_mode("auto", env) == "online" and login_key(env) == "k123"
    (home / ".config" / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.example.com\n")
    assert base_url(env) == "https://wandb.example.com"
    assert resolve_mode("auto", env) == "offline"  # the key is for another host
    other = tmp_path / "netrc"
    other.write_text("machine wandb.example.com login user password k456\n")
    assert login_key({**env, "NETRC": str(other)}) == "k456"
    assert resolve_mode("auto", {**env, "NETRC": str(other)}) == "online"


def test_scalars_keeps_numbers_and_restores_nonfinite():
    rec = {"step": 7, "loss": 2.5, "skipped": True, "val_loss": "nan", "grad_norm": "inf", "policy": "snip",
           "replan": {"solve_s": 0.25, "stats_s": 1}}
    out = scalars(rec)
    assert set(out) == {"loss", "skipped", "val_loss", "grad_norm", "replan/solve_s", "replan/stats_s"}
    assert out["skipped"] == 1 and math.isnan(out["val_loss"]) and out["grad_norm"] == math.inf


def test_from_config_is_off_unless_asked(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert WandbSink.from_config(load_config(None, [f"training.run_dir={run_dir}"]), is_writer=True) is None
    on = load_config(None, [f"training.run_dir={run_dir}", "logging.wandb_project=p"])
    assert WandbSink.from_config(on, is_writer=False) is None  # only global rank 0 logs
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbSink.from_config(on, is_writer=True) is None
    assert not (tmp_path / "run").exists()


def _png(path: Path, seed: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1, 2], [seed, 1, 0])
    fig.savefig(path, dpi=50)
    plt.close(fig)
    return path


def _records(run_dir: Path) -> list[dict]:
    """The offline run's transaction log, decoded by W&B itself."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(log), "--json"],
                         check=False, capture_output=True, text=True, timeout=60)
    if res.returncode != 0 and "No such command" in res.stderr:
        pytest.skip("this wandb has no `wandb leet inspect` (needs wandb >= 0.2x) to read offline runs back")
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


@needs_wandb
def test_offline_run_holds_scalars_plan_table_and_images(tmp_path, monkeypatch):
    map_png, timeline_png = _png(tmp_path / "map.png", 0), _png(tmp_path / "timeline.png", 1)  # before HOME moves
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, "/nonexistent")  # restored after the test; the sink must replace them
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"training.run_dir={run_dir}", "logging.wandb_project=snip-test",
                             "logging.wandb_mode=offline", "logging.wandb_run_name=unit"])
    sink = WandbSink.from_config(cfg, is_writer=True, system_stats=False)
    assert sink is not None and sink.mode == "offline"

    logger = RunLogger(run_dir, is_writer=True, sinks=[sink])
    logger.log_metrics(10, {"loss": 2.5, "lr": 1e-3, "grad_norm": float("inf"), "skipped_steps": 0})
    logger.log_metrics(20, {"loss": 2.0, "val_loss": 2.25, "fp4_share": 0.75})
    entries = {g: ("nvfp4" if g.linear in ("fc1", "qkv") else "fp8") for g in all_gemm_ids(2)}
    plan = PrecisionPlan.create(entries, NUMEL, step=20, policy="snip")
    sink.log_plan(plan, map_png)
    sink.log_timeline(timeline_png, step=20)
    logger.close()  # closes the sink: run.finish() flushes the offline file
    sink.close()  # idempotent

    records = _records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    scalars_at = {h["step"]: h for h in history if "loss" in h}
    assert scalars_at[10]["loss"] == 2.5 and scalars_at[10]["lr"] == 1e-3 and scalars_at[10]["skipped_steps"] == 0
    assert scalars_at[20]["val_loss"] == 2.25 and scalars_at[20]["fp4_share"] == 0.75
    run_rec = next(r["run"] for r in records if r["type"] == "run")
    assert run_rec["project"] == "snip-test" and run_rec["display_name"] == "unit"
    assert run_rec["config"]["update"]["model"]["num_layers"] == cfg.model.num_layers

    files_dir = next(run_dir.glob("wandb/offline-run-*/files"))
    (plan_row,) = [h for h in history if "plan/table.path" in h]
    assert plan_row["step"] == 20 and plan_row["plan/fp4_flops_share"] == pytest.approx(plan.fp4_flops_share)
    assert plan_row["plan/count/nvfp4"] == 12 and plan_row["plan/count/fp8"] == 12
    table = json.loads((files_dir / plan_row["plan/table.path"]).read_text())
    assert table["columns"] == ["layer", "linear", "gemm", "format"]
    assert {GemmId(layer, lin, gemm): fmt for layer, lin, gemm, fmt in table["data"]} == plan.as_dict()
    for key in ("plan/map", "plan/timeline"):
        (row,) = [h for h in history if f"{key}.path" in h]
        assert (files_dir / row[f"{key}.path"]).read_bytes().startswith(PNG_MAGIC)

    # Hermetic: every W&B file lives in the run directory, nothing under $HOME.
    assert not [p for p in (tmp_path / "home").rglob("*") if "wandb" in p.name]
    assert (run_dir / "wandb" / "run_id.txt").read_text().strip() == run_rec["run_id"]


@needs_wandb
def test_missing_image_is_a_clear_error(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, "/nonexistent")
    with (WandbSink(tmp_path / "run", project="p", mode="offline", system_stats=False) as sink,
          pytest.raises(ValueError, match="does not exist")):
        sink.log_timeline(tmp_path / "nope.png")


@needs_wandb
def test_unreachable_server_falls_back_to_offline(tmp_path, monkeypatch):
    """Online mode with a server that refuses connections (localhost port 9, no real network):
    training must not stop - the sink says why and logs offline (~8 s of W&B's own retries)."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, "/nonexistent")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    said: list[str] = []
    sink = WandbSink(tmp_path / "run", project="p", mode="online", system_stats=False, init_timeout=1,
                     info=said.append)
    sink.log(1, {"loss": 1.0})
    sink.close()
    assert sink.mode == "offline" and "logging offline" in said[0] and "wandb sync" in said[0]
    assert list((tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb"))


# --- scripts/plot_run.py -------------------------------------------------------------------
def _plot_run_module():
    spec = importlib.util.spec_from_file_location("plot_run", REPO / "scripts" / "plot_run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _fake_run(path: Path, policy_overrides: list[str], offset: float) -> Path:
    path.mkdir(parents=True)
    (path / "config.toml").write_text(load_config(None, policy_overrides).to_toml())
    lines = [json.dumps({"step": s, "loss": 5.0 / (1 + s / 20) + offset, "lr": 1e-3}) for s in range(10, 210, 10)]
    lines += [json.dumps({"step": s, "val_loss": 5.2 / (1 + s / 20) + offset}) for s in (50, 100, 150, 200)]
    lines.append(json.dumps({"step": 200, "loss": "nan"}))  # a skipped last step: replaces the earlier value
    lines.append('{"step": 210, "lo')  # a run still writing its last line
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_plot_run_reads_runs_and_writes_png(tmp_path):
    plot_run = _plot_run_module()
    a = _fake_run(tmp_path / "bf16_s0", ["precision.initial_plan=bf16"], 0.0)
    b = _fake_run(tmp_path / "snip_s0", ["snip.enabled=true", "snip.fp4_target=0.75"], 0.03)
    run = plot_run.load_run(b)
    assert run.label == "snip_s0 (snip, FP4 >= 0.75)"
    steps, values = run.series["loss"]
    assert steps[0] == 10 and steps[-1] == 200 and math.isnan(values[-1])
    assert run.series["val_loss"][0] == [50, 100, 150, 200]
    assert plot_run.load_run(a).policy == "bf16"

    out = tmp_path / "figs" / "loss.png"
    assert plot_run.main([str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    assert plot_run.main([str(a), "--out", str(tmp_path / "x.png"), "--metric", "no_such_metric"]) == 2
    with pytest.raises(ValueError, match="metrics.jsonl"):
        plot_run.load_run(tmp_path)


@needs_wandb
def test_offline_wandb_run_of_a_snip_training(small_overrides, tmp_path, monkeypatch):
    """The trainer wires the sink: a short SNIP run leaves scalars, a plan table per re-plan, the
    precision maps and the timeline in the offline W&B run inside the run directory."""
    from megatron_snip.training.run import run_training

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(REPO / "launch/configs/tiny.toml", small_overrides + [
        "logging.wandb_project=snip-test", "logging.wandb_mode=offline", "snip.enabled=true", "snip.warmup=1",
        "snip.interval=2", "snip.probe_batches=1", "snip.noise_draws=1", "training.max_steps=4",
        "training.log_interval=1", "training.eval_interval=2"])
    run_training(cfg)
    history = [r["history"]["item"] for r in _records(tmp_path / "run") if r["type"] == "history"]
    assert {h["step"] for h in history if "loss" in h} == {1, 2, 3, 4}
    assert any("val_loss" in h for h in history)
    plan_steps = sorted(h["step"] for h in history if "plan/table.path" in h)
    assert plan_steps == [1, 3]
    assert any("plan/map.path" in h for h in history) and any("plan/timeline.path" in h for h in history)
    assert any("replan_stats_s" in h for h in history)
    assert (tmp_path / "run" / "timeline.png").read_bytes().startswith(PNG_MAGIC)
    # Per-GEMM costs (ΔL for fprop, λ·ΔW for dgrad/wgrad) behind each SNIP plan, and the final map.
    files_dir = next((tmp_path / "run").glob("wandb/offline-run-*/files"))
    cost_rows = [h for h in history if "plan/costs.path" in h]
    assert sorted(h["step"] for h in cost_rows) == [1, 3]
    costs = json.loads((files_dir / cost_rows[0]["plan/costs.path"]).read_text())
    assert costs["columns"] == ["layer", "linear", "gemm", "metric", "chosen", "fp8", "nvfp4"]
    assert len(costs["data"]) == 2 * 4 * 3 and {r[3] for r in costs["data"]} == {"dL", "dW"}
    assert all(r[3] == ("dL" if r[2] == "fprop" else "dW") and r[4] in ("fp8", "nvfp4") for r in costs["data"])
    (final,) = [h for h in history if "final/map.path" in h]
    assert (files_dir / final["final/map.path"]).read_bytes().startswith(PNG_MAGIC) and "final/table.path" in final
