"""Weights & Biases sink for the rank-0 ``RunLogger``: scalars, precision plans, figures.

    sink = WandbSink.from_config(cfg, run_dir, is_writer=topo.rank == 0)   # None when off
    logger = RunLogger(run_dir, is_writer=..., sinks=[sink] if sink else [])
    sink.log_plan(plan, run_dir / "plans" / "step_000300.png")             # after each re-plan
    sink.log_timeline(run_dir / "timeline.png")                             # at the end

Optional but first-class: ``logging.wandb_project = ""`` turns it off; once a project is set,
a missing ``wandb`` package is a config error. ``wandb`` is imported lazily, only on the
rank that logs. Mode ``auto`` means ``$WANDB_MODE`` if set, else online iff there is an API
key (``WANDB_API_KEY``, or the one ``wandb login`` put in ~/.netrc / ``$NETRC``), else offline - an offline run needs no account and no network (``wandb sync
<run_dir>/wandb/offline-run-*`` uploads it later). An online run that cannot reach the server
within ``init_timeout`` seconds falls back to offline instead of stopping training; after
``init``, uploads happen in W&B's own service process and never block a training step.

Hermetic: every W&B file of a run lives under its run directory - ``WANDB_DIR`` (run files),
``WANDB_CACHE_DIR``, ``WANDB_CONFIG_DIR`` and ``WANDB_DATA_DIR`` (artifact staging) are set
to ``<run_dir>`` and ``<run_dir>/wandb/{cache,config,data}``, overriding the environment (W&B
would otherwise write into ~/.cache/wandb and ~/.config/wandb). Self-hosted servers: the host
saved by ``wandb login --host`` (or ``WANDB_BASE_URL``) is read before the config dir moves.

Metrics use ``step`` (the optimizer step) as their x-axis (``define_metric``), so records
logged out of order - a plan and a metrics line for the same step, a resumed run - are kept.
"""

from __future__ import annotations

import configparser
import math
import netrc
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlparse

from megatron_snip.config import Config
from megatron_snip.precision.plan import PrecisionPlan

PLAN_COLUMNS = ("layer", "linear", "gemm", "format")
COST_COLUMNS = ("layer", "linear", "gemm", "metric", "chosen")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}


def resolve_mode(mode: str, env: Mapping[str, str] | None = None) -> str:
    """``logging.wandb_mode`` -> "online", "offline" or "disabled" (see the module docstring)."""
    env = os.environ if env is None else env
    if mode in ("online", "offline", "disabled"):
        return mode
    if mode != "auto":
        raise ValueError(f"config logging.wandb_mode={mode!r}: choose 'auto', 'online', 'offline' or 'disabled'")
    forced = env.get("WANDB_MODE", "").strip().lower()
    if forced in ("online", "offline", "disabled"):
        return forced
    if forced == "dryrun":  # W&B's old name for offline
        return "offline"
    return "online" if login_key(env) else "offline"


DEFAULT_BASE_URL = "https://api.wandb.ai"


def base_url(env: Mapping[str, str] | None = None) -> str:
    """The W&B server: ``$WANDB_BASE_URL``, else the ``base_url`` that ``wandb login --host``
    saved in the user's W&B settings (``$WANDB_CONFIG_DIR`` or ~/.config/wandb), else wandb.ai."""
    env = os.environ if env is None else env
    if env.get("WANDB_BASE_URL"):
        return env["WANDB_BASE_URL"]
    config_dir = env.get("WANDB_CONFIG_DIR") or os.path.join(env.get("HOME", os.path.expanduser("~")), ".config", "wandb")
    parser = configparser.ConfigParser()
    try:
        parser.read(os.path.join(config_dir, "settings"))
    except configparser.Error:
        return DEFAULT_BASE_URL
    return parser.get("default", "base_url", fallback=DEFAULT_BASE_URL) or DEFAULT_BASE_URL


def login_key(env: Mapping[str, str] | None = None) -> str | None:
    """The API key W&B would use: ``$WANDB_API_KEY``, else the one ``wandb login`` stored in the
    netrc file (``$NETRC`` or ~/.netrc) for the server's host; None when there is none."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return env["WANDB_API_KEY"]
    host = urlparse(base_url(env)).hostname
    path = env.get("NETRC") or os.path.join(env.get("HOME", os.path.expanduser("~")), ".netrc")
    if not host or not os.path.isfile(path):
        return None
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return auth[2] if auth and auth[2] else None


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float | int]:
    """The numeric entries of a metrics record, nested dicts flattened as ``a/b``.

    Booleans become 0/1; the strings "nan"/"inf"/"-inf" (how ``RunLogger`` writes non-finite
    floats to JSON) become floats again; other strings and objects are skipped; ``step`` is
    dropped (it is the x-axis, passed separately).
    """
    out: dict[str, float | int] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if name == "step":
            continue
        if hasattr(value, "item") and callable(value.item):  # 0-d tensors / numpy scalars
            value = value.item()
        if isinstance(value, Mapping):
            out.update(scalars(value, prefix=f"{name}/"))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, str) and value.strip().lower() in _NONFINITE:
            out[name] = _NONFINITE[value.strip().lower()]
    return out


def plan_scalars(plan: PrecisionPlan) -> dict[str, float | int]:
    """The numbers logged for a plan: ``plan/fp4_flops_share``, ``plan/count/<format>`` and, when
    the plan was solved, ``plan/objective``; under a run-level FP4 budget (``snip.budget = "run"``)
    ``plan/run_target``, ``plan/budget_interval_share``, ``plan/budget_spent`` and
    ``plan/budget_unspent`` (every sink logs these)."""
    out: dict[str, float | int] = {"plan/fp4_flops_share": plan.fp4_flops_share}
    out.update({f"plan/count/{fmt}": n for fmt, n in plan.format_counts().items()})
    if plan.objective is not None:
        out["plan/objective"] = plan.objective
    extra = dict(plan.extra)
    if extra.get("budget") == "run":
        out.update({f"plan/{k}": extra[k] for k in ("run_target", "budget_interval_share", "budget_spent",
                                                     "budget_unspent")})
    return out


def plan_caption(plan: PrecisionPlan) -> str:
    """The caption of a plan's precision map."""
    return f"step {plan.step}, {plan.policy}, FP4 share {plan.fp4_flops_share:.3f}, hash {plan.hash}"


def _git_root(start: Path) -> Path | None:
    for d in (start, *start.parents):
        if (d / ".git").exists():
            return d
    return None


class WandbSink:
    """One W&B run, written only by the rank that creates it (global rank 0).

    Args:
        run_dir: the run directory; W&B files go to ``<run_dir>/wandb``.
        project, entity, name: W&B project, entity ("" = your default) and run name
            ("" = the run directory's name).
        mode: "online" or "offline" (resolve "auto" with ``resolve_mode`` first).
        config: the resolved config as a nested dict (``Config.to_dict()``).
        resume: continue the W&B run of an earlier process on this run directory (its id is
            kept in ``<run_dir>/wandb/run_id.txt``).
        system_stats: let W&B sample CPU/GPU utilization.
        init_timeout: seconds an online ``wandb.init`` may wait for the server.
        info: where to report a fallback to offline (default: stderr).
    """

    def __init__(self, run_dir: str | Path, *, project: str, entity: str = "", name: str = "",
                 mode: str = "offline", config: Mapping[str, Any] | None = None, resume: bool = False,
                 system_stats: bool = True, init_timeout: float = 30.0,
                 info: Callable[[str], None] | None = None) -> None:
        if not project:
            raise ValueError("WandbSink project is empty; set config logging.wandb_project (or leave W&B off)")
        if mode not in ("online", "offline"):
            raise ValueError(f"WandbSink mode={mode!r}: choose 'online' or 'offline' "
                             "(resolve 'auto' with resolve_mode)")
        try:
            import wandb
        except ImportError:
            raise ValueError(f"config logging.wandb_project={project!r} needs the wandb package: pip install wandb, "
                             "or set logging.wandb_project=\"\" to log to metrics.jsonl only") from None
        self._wandb = wandb
        self.run_dir = Path(run_dir).resolve()
        self._info = info or (lambda msg: print(msg, file=sys.stderr, flush=True))
        wandb_dir = self.run_dir / "wandb"
        # The config dir moves into the run directory below; keep the server `wandb login --host`
        # saved there (the key itself lives in ~/.netrc, which W&B reads wherever its config is).
        server = base_url(os.environ)
        if server != DEFAULT_BASE_URL:
            os.environ["WANDB_BASE_URL"] = server
        for var, path in (("WANDB_DIR", self.run_dir), ("WANDB_CACHE_DIR", wandb_dir / "cache"),
                          ("WANDB_CONFIG_DIR", wandb_dir / "config"), ("WANDB_DATA_DIR", wandb_dir / "data")):
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
        id_file = wandb_dir / "run_id.txt"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None  # None: W&B picks one

        git_root = _git_root(Path.cwd())
        settings: dict[str, Any] = {
            "console": "off",  # stdout/stderr belong to the launcher's log; wrapping them fights tqdm
            "quiet": True, "init_timeout": init_timeout, "x_disable_stats": not system_stats,
        }
        if git_root is not None:
            settings["git_root"] = str(git_root)  # record the code's commit, not the run dir's
        else:
            settings["disable_git"] = True
        init: dict[str, Any] = {
            "project": project, "entity": entity or None, "name": name or self.run_dir.name,
            "dir": str(self.run_dir), "config": dict(config or {}), "id": run_id, "resume": "allow",
            "reinit": "create_new",  # several runs in one process (tests, sweeps) stay separate
        }
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **init)
        except Exception as e:  # any failure to reach the server: keep training, log offline
            if mode != "online":
                raise
            self._info(f"W&B: online init failed ({type(e).__name__}: {e}); logging offline to {wandb_dir} "
                       f"instead - upload later with `wandb sync {wandb_dir}/offline-run-*`")
            mode = "offline"
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **init)
        self.mode = mode
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path | None = None, *, is_writer: bool,
                    info: Callable[[str], None] | None = None, **kwargs: Any) -> WandbSink | None:
        """The sink ``cfg.logging`` asks for, or None (not rank 0, no project, or mode disabled).

        ``run_dir`` defaults to ``cfg.training.run_dir``; ``kwargs`` go to the constructor.
        """
        lg = cfg.logging
        if not is_writer or not lg.wandb_project:
            return None
        mode = resolve_mode(lg.wandb_mode)
        if mode == "disabled":
            return None
        return cls(run_dir if run_dir is not None else cfg.training.run_dir, project=lg.wandb_project,
                   entity=lg.wandb_entity, name=lg.wandb_run_name, mode=mode, config=cfg.to_dict(),
                   resume=cfg.training.resume, info=info, **kwargs)

    # --- RunLogger sink interface -----------------------------------------------------
    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Log every scalar of ``record`` (loss, lr, grad_norm, val losses, timings, ...) at ``step``."""
        data = scalars(record)
        if data and not self._closed:
            self.run.log({"step": step, **data})

    def close(self) -> None:
        """Finish the run (flushes the offline file); safe to call twice."""
        if not self._closed:
            self._closed = True
            self.run.finish()

    # --- plans and figures ----------------------------------------------------------------
    def log_plan(self, plan: PrecisionPlan, png_path: str | Path | None = None,
                 costs: Mapping[Any, Mapping[str, float]] | None = None) -> None:
        """Log ``plan`` at ``plan.step``: a Table (layer, linear, gemm, format), its FP4 FLOP
        share, its format counts, when given the precision-map PNG
        (``telemetry.plots.plot_precision_map``) and, when given, the per-GEMM costs the plan
        was solved from as a Table ``plan/costs`` (``COST_COLUMNS`` + one column per format:
        ΔL for fprop rows, λ·ΔW for dgrad/wgrad rows, normalized as in snip/metrics.py)."""
        wandb = self._wandb
        table = wandb.Table(columns=list(PLAN_COLUMNS),
                            data=[[g.layer, g.linear, g.gemm, fmt] for g, fmt in plan.entries])
        data: dict[str, Any] = {"step": plan.step, "plan/table": table, **plan_scalars(plan)}
        if costs:
            formats = sorted({f for per in costs.values() for f in per})
            chosen = plan.as_dict()
            rows = [[g.layer, g.linear, g.gemm, "dL" if g.gemm == "fprop" else "dW", chosen.get(g),
                     *(float(per.get(f, math.nan)) for f in formats)] for g, per in sorted(costs.items())]
            data["plan/costs"] = wandb.Table(columns=[*COST_COLUMNS, *formats], data=rows)
        if png_path is not None:
            data["plan/map"] = wandb.Image(str(self._existing(png_path)), caption=plan_caption(plan))
        if not self._closed:
            self.run.log(data)

    def log_final_plan(self, plan: PrecisionPlan, png_path: str | Path, step: int) -> None:
        """Log the plan in force at the end of training: its precision map (``final/map``), its
        table (``final/table``) and its FP4 share / hash in the run summary."""
        wandb = self._wandb
        data = {"step": step, "final/table": wandb.Table(columns=list(PLAN_COLUMNS),
                                                         data=[[g.layer, g.linear, g.gemm, f] for g, f in plan.entries]),
                "final/map": wandb.Image(str(self._existing(png_path)), caption="final plan: " + plan_caption(plan))}
        if not self._closed:
            self.run.log(data)
            self.run.summary.update({"final/fp4_flops_share": plan.fp4_flops_share, "final/plan_hash": plan.hash,
                                     "final/plan_step": plan.step})

    def log_timeline(self, png_path: str | Path, step: int | None = None) -> None:
        """Log the plan-timeline PNG (``telemetry.plots.plot_timeline``), at ``step`` if given."""
        data: dict[str, Any] = {"plan/timeline": self._wandb.Image(str(self._existing(png_path)))}
        if step is not None:
            data["step"] = step
        if not self._closed:
            self.run.log(data)

    @staticmethod
    def _existing(path: str | Path) -> Path:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"image {str(path)!r} does not exist; write it first (telemetry.plots)")
        return path

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
