"""Precision plans: which format each GEMM of each linear layer runs in.

A decision unit is a ``GemmId(layer, linear, gemm)``:
  * ``layer``  - global transformer-block index (the same on every pipeline stage),
  * ``linear`` - one of ``qkv``, ``proj``, ``fc1`` (gate+up), ``fc2`` (down),
  * ``gemm``   - ``fprop`` (Y = X·Wᵀ), ``dgrad`` (dX = dY·W), ``wgrad`` (dW = dYᵀ·X).

A ``PrecisionPlan`` is an immutable mapping GemmId -> format name plus the step it
was made at, the policy that made it, the solver's objective and status. It
round-trips through JSON and has a hash that is identical on every rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_snip.precision.formats import FORMATS, FP4_FORMATS

LINEARS: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
# A plan's decision unit (snip.granularity): each GEMM alone, or a linear's three GEMMs together.
GRANULARITIES: tuple[str, ...] = ("gemm", "layer")


@dataclass(frozen=True, order=True)
class GemmId:
    """Global name of one GEMM: ``GemmId(17, "fc2", "wgrad")``."""

    layer: int
    linear: str
    gemm: str

    def __post_init__(self) -> None:
        if self.linear not in LINEARS:
            raise ValueError(f"GemmId.linear={self.linear!r} is not one of {LINEARS}")
        if self.gemm not in GEMMS:
            raise ValueError(f"GemmId.gemm={self.gemm!r} is not one of {GEMMS}")
        if self.layer < 0:
            raise ValueError(f"GemmId.layer={self.layer} must be >= 0")

    @property
    def key(self) -> str:
        """The JSON key ``"<layer>.<linear>.<gemm>"``."""
        return f"{self.layer}.{self.linear}.{self.gemm}"

    @classmethod
    def parse(cls, key: str) -> GemmId:
        parts = key.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            raise ValueError(f"plan entry key {key!r} is not '<layer>.<linear>.<gemm>' (e.g. '3.fc2.wgrad')")
        return cls(int(parts[0]), parts[1], parts[2])


def all_gemm_ids(num_layers: int, layers: Iterable[int] | None = None) -> list[GemmId]:
    """Every GemmId of a model with ``num_layers`` blocks (or of the given ``layers``), in canonical order."""
    layer_range = range(num_layers) if layers is None else layers
    return [GemmId(layer, lin, g) for layer in layer_range for lin in LINEARS for g in GEMMS]


@dataclass(frozen=True)
class GemmPrecision:
    """The formats of one linear layer's three GEMMs - what a PrecisionLinear runs with."""

    fprop: str = "bf16"
    dgrad: str = "bf16"
    wgrad: str = "bf16"

    def __post_init__(self) -> None:
        for gemm in GEMMS:
            name = getattr(self, gemm)
            if name not in FORMATS:
                raise ValueError(f"GemmPrecision.{gemm}={name!r} is not a known format {sorted(FORMATS)}")

    @classmethod
    def uniform(cls, fmt: str) -> GemmPrecision:
        return cls(fmt, fmt, fmt)

    def __getitem__(self, gemm: str) -> str:
        return getattr(self, gemm)

    @property
    def is_reference(self) -> bool:
        """Every GEMM BF16: the unquantized reference path (``F.linear``, precision/gemm.py)."""
        return all(self[g] == "bf16" for g in GEMMS)


def fp4_flops_share(entries: Mapping[GemmId, str], linear_numel: Mapping[str, int]) -> float:
    """Fraction of linear-layer training FLOPs whose GEMM runs in an FP4 format.

    Each of a linear's three GEMMs costs 2·T·K·N FLOPs, so a GEMM's weight in the
    share is its linear's K·N (``linear_numel[linear]``); T cancels. Embedding and
    LM head are not linear-layer GEMMs here and are excluded.
    """
    total = sum(linear_numel[g.linear] for g in entries)
    fp4 = sum(linear_numel[g.linear] for g, f in entries.items() if f in FP4_FORMATS)
    return fp4 / total if total else 0.0


@dataclass(frozen=True)
class PrecisionPlan:
    """Immutable GemmId -> format mapping with provenance.

    ``entries`` is stored as a sorted tuple of (GemmId, format) pairs so the plan
    is hashable and its JSON canonical.
    """

    entries: tuple[tuple[GemmId, str], ...]
    step: int = 0
    policy: str = "bf16"
    fp4_flops_share: float = 0.0
    objective: float | None = None
    solver_status: str | None = None
    extra: tuple[tuple[str, Any], ...] = field(default=())

    @classmethod
    def create(
        cls,
        entries: Mapping[GemmId, str],
        linear_numel: Mapping[str, int],
        *,
        step: int = 0,
        policy: str = "bf16",
        objective: float | None = None,
        solver_status: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> PrecisionPlan:
        """Build a plan, computing its FP4 FLOP share from the linears' K·N sizes."""
        for gid, fmt in entries.items():
            if fmt not in FORMATS:
                raise ValueError(f"plan entry {gid.key}={fmt!r} is not a known format {sorted(FORMATS)}")
        return cls(
            entries=tuple(sorted(entries.items())),
            step=step,
            policy=policy,
            fp4_flops_share=fp4_flops_share(entries, linear_numel),
            objective=objective,
            solver_status=solver_status,
            extra=tuple(sorted((extra or {}).items())),
        )

    @classmethod
    def uniform(cls, fmt: str, num_layers: int, linear_numel: Mapping[str, int], **kw: Any) -> PrecisionPlan:
        kw.setdefault("policy", f"uniform:{fmt}")
        return cls.create({g: fmt for g in all_gemm_ids(num_layers)}, linear_numel, **kw)

    # --- access -----------------------------------------------------------------
    def as_dict(self) -> dict[GemmId, str]:
        return dict(self.entries)

    def gemm_ids(self) -> list[GemmId]:
        return [g for g, _ in self.entries]

    def for_linear(self, layer: int, linear: str) -> GemmPrecision:
        d = self.as_dict()
        try:
            return GemmPrecision(*(d[GemmId(layer, linear, g)] for g in GEMMS))
        except KeyError as e:
            raise KeyError(f"plan has no entry for {e.args[0].key}") from None

    def format_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, f in self.entries:
            counts[f] = counts.get(f, 0) + 1
        return counts

    # --- validation -------------------------------------------------------------
    def validate(self, expected: Iterable[GemmId]) -> None:
        """Reject unknown and missing GEMMs (ValueError listing a few of each)."""
        expected_set = set(expected)
        have = {g for g, _ in self.entries}
        unknown = sorted(have - expected_set)
        missing = sorted(expected_set - have)
        if unknown or missing:
            layers = len({g.layer for g in expected_set})
            what = []
            if unknown:
                what.append(f"{len(unknown)} 'entries' key(s) name no GEMM of this model, e.g. {[g.key for g in unknown[:4]]}")
            if missing:
                what.append(f"{len(missing)} of its GEMMs have no entry, e.g. {[g.key for g in missing[:4]]}")
            raise ValueError(f"precision plan (policy {self.policy!r}, step {self.step}, {len(have)} entries) does not "
                             f"match the model ({layers} layers x 4 linears x 3 GEMMs = {len(expected_set)} entries): "
                             + "; ".join(what) + "; regenerate the plan for this model's num_layers (e.g. "
                             "scripts/solve_plan.py), or give a policy such as precision.initial_plan=uniform:fp8")

    # --- serialization ----------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy": self.policy,
            "fp4_flops_share": self.fp4_flops_share,
            "objective": self.objective,
            "solver_status": self.solver_status,
            "format_counts": self.format_counts(),
            "hash": self.hash,
            "extra": dict(self.extra),
            "entries": {g.key: f for g, f in self.entries},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=1, sort_keys=False)

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any], linear_numel: Mapping[str, int] | None = None) -> PrecisionPlan:
        """A plan from its JSON object. With ``linear_numel`` the FP4 FLOP share is recomputed
        from the entries and a different claimed ``fp4_flops_share`` is refused (a file must not
        decide what gets logged as its FP4 share); without it the recorded share is kept (plans
        this code wrote: checkpoints, broadcasts)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"plan JSON is a {_json_type(d)}, not an object with 'entries', 'step', 'policy'")  # noqa: TRY004 - user input
        raw = d.get("entries")
        if not isinstance(raw, Mapping):
            got = "missing" if raw is None else f"a {_json_type(raw)}"
            raise ValueError(f"plan JSON 'entries' is {got}; it must be an object mapping '<layer>.<linear>.<gemm>' "  # noqa: TRY004
                             f"to a format name, e.g. {{\"0.qkv.fprop\": \"fp8\"}}")
        entries = {}
        for k, fmt in raw.items():
            gid = GemmId.parse(k)
            if not isinstance(fmt, str) or fmt not in FORMATS:
                raise ValueError(f"plan entry {gid.key}={fmt!r} is not a known format name {sorted(FORMATS)}")
            entries[gid] = fmt
        extra = d.get("extra") or {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"plan JSON 'extra' is a {_json_type(extra)}; it must be an object (or left out)")  # noqa: TRY004
        step = d.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"plan JSON 'step'={step!r} must be a non-negative integer")
        policy = d.get("policy", "file")
        if not isinstance(policy, str):
            raise ValueError(f"plan JSON 'policy'={policy!r} must be a string")  # noqa: TRY004
        claimed = d.get("fp4_flops_share")
        if claimed is not None and (isinstance(claimed, bool) or not isinstance(claimed, (int, float))):
            raise ValueError(f"plan JSON 'fp4_flops_share'={claimed!r} must be a number")
        share = float(claimed or 0.0)
        if linear_numel is not None:
            share = fp4_flops_share(entries, linear_numel)
            if claimed is not None and abs(float(claimed) - share) > 1e-6:
                raise ValueError(f"plan JSON claims fp4_flops_share={claimed} but its entries put {share:.4f} of the "
                                 f"linear-layer FLOPs in FP4; fix the entries or drop the field (it is recomputed)")
        plan = cls(
            entries=tuple(sorted(entries.items())),
            step=step,
            policy=policy,
            fp4_flops_share=share,
            objective=d.get("objective"),
            solver_status=d.get("solver_status"),
            extra=tuple(sorted(dict(extra).items())),
        )
        if "hash" in d and d["hash"] != plan.hash:
            raise ValueError(f"plan JSON hash {d['hash']} does not match its contents ({plan.hash}); the file was edited or corrupted")
        return plan

    @classmethod
    def load(cls, path: str | Path, linear_numel: Mapping[str, int] | None = None) -> PrecisionPlan:
        """Read a plan JSON file (``from_json_dict``); every error names the file."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"precision plan file {str(path)!r} is a directory; give a plan JSON file "
                             f"(e.g. runs/x/plans/step_000100.json)")
        if not path.is_file():
            raise ValueError(f"precision plan file {str(path)!r} does not exist")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8-sig")  # a UTF-8 BOM (some editors write one) is not part of the JSON
        except UnicodeDecodeError as e:
            raise ValueError(f"precision plan file {str(path)!r} is not UTF-8 text (byte {e.start}); give a plan "
                             f"JSON file") from None
        if not text.strip():
            raise ValueError(f"precision plan file {str(path)!r} is empty; give a plan JSON file")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"precision plan file {str(path)!r} is not valid JSON ({e})") from None
        try:
            return cls.from_json_dict(obj, linear_numel)
        except ValueError as e:
            raise ValueError(f"precision plan file {str(path)!r}: {e}") from None

    @property
    def hash(self) -> str:
        """sha256 (16 hex chars) of the canonical entries + step + policy; equal on every rank."""
        canon = json.dumps(
            {"step": self.step, "policy": self.policy, "entries": [[g.key, f] for g, f in self.entries]},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def with_extra(self, extra: Mapping[str, Any]) -> PrecisionPlan:
        """This plan with ``extra`` added to (or replacing keys of) its ``extra`` (the hash ignores it)."""
        return replace(self, extra=tuple(sorted({**dict(self.extra), **extra}.items())))

    def with_step(self, step: int) -> PrecisionPlan:
        return PrecisionPlan(self.entries, step, self.policy, self.fp4_flops_share, self.objective, self.solver_status, self.extra)


def _json_type(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)
