"""The results store: ``<out-dir>/results.jsonl``, one JSON record per finished run (the latest
record of a run name wins), and what the records decide: which runs are done, which results are
current, and the sweep's best static baseline."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from experiments.comparison.protocol import (
    BASE_POLICY,
    STATIC_BASELINES,
    TRAIN_DOMAIN,
    Protocol,
    RunSpec,
    fmt_key,
    primary_runs,
    resolved_config,
    same_config,
    sweep_runs,
)


def read_results(path: Path) -> list[dict]:
    """All records of ``results.jsonl`` in file order.

    A line that is not a JSON record (a write torn by a killed driver) is skipped with a
    warning: its run then counts as not done and is trained again.
    """
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict) or "name" not in rec:
            print(f"warning: {path}:{i} is not a results record; ignoring it", file=sys.stderr)
            continue
        out.append(rec)
    return out


def append_record(path: Path, rec: dict) -> None:
    """Append one JSON line; start a new line first if the file ends in a torn one."""
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(rec) + "\n").encode())


def latest_records(records: Iterable[dict]) -> dict[str, dict]:
    """Run name -> its latest record (a rerun appends a newer one)."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["name"]] = r
    return out


def is_done(spec: RunSpec, p: Protocol, latest: Mapping[str, dict]) -> bool:
    """True if ``spec`` finished ok under the same configuration (a rerun skips it)."""
    rec = latest.get(spec.name)
    return rec is not None and rec.get("status") == "ok" and same_config(
        run_identity(spec, rec.get("config")), run_identity(spec, resolved_config(spec, p)))


def run_identity(spec: RunSpec, config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The part of a resolved config that decides a run's outcome: all of it, except for a base run
    (SNIP off) its ``snip`` section. So a SNIP ablation (``--set snip.granularity=gemm``) counts the
    bases of the default's out-dir, copied into its own with their records, as done."""
    if config is None or spec.policy != BASE_POLICY:
        return config
    return {section: values for section, values in config.items() if section != "snip"}


def current_results(p: Protocol, records: Iterable[dict]) -> list[dict]:
    """Latest ok records of this protocol's runs (stale configurations and failures left out)."""
    latest = latest_records(records)
    specs = {r.name: r for r in primary_runs(p)}
    for base in STATIC_BASELINES:  # whichever baseline the sweep picked
        specs.update({r.name: r for r in sweep_runs(p, dict.fromkeys(p.sweep_format_sets, base))})
    return [rec for name, rec in latest.items() if name in specs and is_done(specs[name], p, latest)]


def best_static_baseline(results: Iterable[dict], formats: tuple[str, ...], rho: float,
                         metric: str = TRAIN_DOMAIN) -> str | None:
    """The static baseline with the lowest mean final ``metric`` over seeds at (formats, rho).

    Selection uses the training-domain held-out split by design: the other domains are the
    reported outcome, so choosing on them would bias the comparison in the baseline's favour.
    """
    means = {}
    for pol in STATIC_BASELINES:
        vals = [r["final"][metric] for r in results if r["policy"] == pol and fmt_key(r.get("formats")) == formats
                and r.get("rho") == rho and metric in r.get("final", {})]
        if vals:
            means[pol] = float(np.mean(vals))
    return min(means, key=means.__getitem__) if means else None


