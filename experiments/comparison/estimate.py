"""The time model behind ``--dry-list``: estimated seconds per run, and the listing itself."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from experiments.comparison.protocol import BASE_POLICY, Protocol, RunSpec, config_path
from experiments.comparison.store import is_done
from megatron_snip.config import load_config
from megatron_snip.precision.formats import FP4_FORMATS


def _evals(steps: int, p: Protocol) -> int:
    """Evaluation micro-batches of a run of ``steps`` steps (every eval_interval and at the end, per domain)."""
    return (steps // p.eval_interval + 1) * p.eval_batches * len(p.domains)


def _truth_batches(p: Protocol) -> int:
    """The runs' ``snip.truth_batches``, as their configuration resolves it."""
    return load_config(config_path(p), list(p.overrides)).snip.truth_batches


@dataclass(frozen=True)
class CostModel:
    """Seconds per run, for ``--dry-list``: startup + steps x step time x emulation factor + re-plans + evals.

    ``step_s`` is the BF16 step time of one job while ``jobs`` run at once. Emulation factors
    and the re-plan cost can come from a ``python -m experiments.bench.overheads`` JSON (``--overheads``).
    """

    step_s: float
    startup_s: float = 10.0
    # Measured in the recorded default comparison (docs/results/comparison/results.md, "Cost": compiled quantizers, two
    # 1-thread jobs): mean train seconds of the uniform runs over the BF16 runs', and the re-plan time.
    emulation: Mapping[str, float] = field(default_factory=lambda: {"bf16": 1.0, "fp8": 1.30, "nvfp4": 1.64, "mxfp4": 1.41})
    replan_steps: float = 32.0  # one statistics re-plan, in BF16 training steps (same measurement)
    # A re-plan of the truth oracle per measured micro-batch (snip.truth_batches), in BF16 steps: 104 s for
    # 2 batches against a 0.27 s step, 1.66M model (8 blocks, 2 formats), one thread (ablation protocol).
    truth_replan_steps_per_batch: float = 190.0
    eval_step_fraction: float = 0.33  # one eval micro-batch forward, in training steps

    def run_s(self, spec: RunSpec, p: Protocol) -> float:
        if spec.policy == BASE_POLICY:
            return self.startup_s + (p.base_steps + _evals(p.base_steps, p) * self.eval_step_fraction) * self.step_s
        if spec.policy == "bf16":
            shares = {"bf16": 1.0}
        elif spec.policy.startswith("uniform:"):
            shares = {spec.policy.split(":", 1)[1]: 1.0}
        else:
            fs = spec.formats or p.format_sets[0]
            high = next((f for f in fs if f not in FP4_FORMATS), "bf16")
            # The fast format (the non-high one of a gemm_time set such as bf16,fp8) at share rho: an estimate.
            fp4 = next((f for f in fs if f in FP4_FORMATS), next((f for f in fs if f != high), high))
            shares = {fp4: spec.rho, high: 1.0 - spec.rho}
        factor = sum(w * self.emulation.get(f, 2.0) for f, w in shares.items())
        train = p.warmup * self.step_s + (p.steps - p.warmup) * self.step_s * factor
        replans = len(range(p.warmup, p.steps, p.interval)) if spec.policy in ("snip", "min_rel_err", "truth") else 0
        replan_steps = self.truth_replan_steps_per_batch * _truth_batches(p) if spec.policy == "truth" else self.replan_steps
        evals = _evals(p.steps, p)
        return self.startup_s + train + replans * replan_steps * self.step_s \
            + evals * self.eval_step_fraction * self.step_s * factor

    @classmethod
    def from_overheads(cls, path: Path, step_s: float) -> CostModel:
        if not path.is_file():
            raise ValueError(f"--overheads={str(path)!r} does not exist; write it with "
                             f"python -m experiments.bench.overheads --out {path}")
        d = json.loads(path.read_text())
        emul = {f: float(v["ratio"]) for f, v in d.get("emulation", {}).get("formats", {}).items() if "ratio" in v}
        kw = {}
        if emul:
            kw["emulation"] = {"bf16": 1.0, **emul}
        if "replan" in d and "replan_over_step" in d["replan"]:
            kw["replan_steps"] = float(d["replan"]["replan_over_step"])
        return cls(step_s, **kw)


def dry_list(specs: Sequence[RunSpec], p: Protocol, cost: CostModel, jobs: int, latest: Mapping[str, dict]) -> str:
    lines = [f"{'run':<44} {'group':<7} {'est_s':>6}  status"]
    todo_s = 0.0
    for s in specs:
        est = cost.run_s(s, p)
        done = is_done(s, p, latest)
        todo_s += 0.0 if done else est
        lines.append(f"{s.name:<44} {s.group:<7} {est:>6.0f}  {'done' if done else 'todo'}")
    total = sum(cost.run_s(s, p) for s in specs)
    lines.append(f"{len(specs)} runs; estimated {total / 60 / max(1, jobs):.0f} min in all, "
                 f"{todo_s / 60 / max(1, jobs):.0f} min still to run, with {jobs} job(s) at a time "
                 f"(BF16 step {cost.step_s:.3f} s per job, emulation factors {dict(cost.emulation)}, "
                 f"re-plan = {cost.replan_steps:.0f} steps; default factors: measured in the default comparison, "
                 f"compiled quantizers; "
                 f"pass --overheads <experiments.bench.overheads JSON> for others)")
    return "\n".join(lines)


