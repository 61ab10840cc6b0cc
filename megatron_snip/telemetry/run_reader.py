"""Read a run directory back: the curves of ``metrics.jsonl`` (written by ``telemetry.logger.RunLogger``)
and the policy named in its ``config.toml`` - the one reader, so every tool that looks at finished
runs (``scripts/plot_run.py``, the policy comparison) reads them the same way."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Run:
    """One run directory's curves: ``series[metric] = (steps, values)``."""

    path: Path
    name: str
    policy: str
    series: dict[str, tuple[list[int], list[float]]]

    @property
    def label(self) -> str:
        return f"{self.name} ({self.policy})"


def _number(v: object) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan" / "inf" as RunLogger writes them
        except ValueError:
            return None
    return None


def policy_of(run_dir: Path) -> str:
    """The run's precision policy from its ``config.toml`` ("?" when there is none)."""
    cfg_path = run_dir / "config.toml"
    if not cfg_path.is_file():
        return "?"
    cfg = tomllib.loads(cfg_path.read_text())
    snip, precision = cfg.get("snip", {}), cfg.get("precision", {})
    if snip.get("enabled"):
        return f"{snip.get('policy', 'snip')}, FP4 >= {snip.get('fp4_target', '?')}"
    return str(precision.get("initial_plan", "?"))


def load_run(run_dir: str | Path) -> Run:
    """Read ``metrics.jsonl``; a later record for a step replaces an earlier one (resumed runs)."""
    path = Path(run_dir)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"run directory {str(path)!r} has no metrics.jsonl; pass a directory a training run wrote")
    by_metric: dict[str, dict[int, float]] = {}
    lines = metrics_path.read_text().splitlines()
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if line_no == len(lines):
                continue  # a run still writing its last line
            raise ValueError(f"{metrics_path}:{line_no} is not JSON") from None
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        for key, value in rec.items():
            num = _number(value)
            if key != "step" and num is not None:
                by_metric.setdefault(key, {})[step] = num
    series = {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_metric.items()}
    return Run(path, path.resolve().name, policy_of(path), series)


__all__ = ["Run", "load_run", "policy_of"]
