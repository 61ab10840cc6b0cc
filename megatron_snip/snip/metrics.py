"""SNIP divergence metrics from a statistics snapshot (pure: no ranks, logging or clocks).

For linear ℓ and candidate format f (notation of docs/snip.md; n probe micro-batches,
each with its own loss L_b, G_b = ∂L_b/∂Y_b):

    loss divergence    ΔL(ℓ,f) = F(ℓ,f)  +  ½ · max(κ_ℓ, 0) · (1/n) Σ_b ‖e_Y,b(f)‖², with the first-order
                       term F by the snapshot's "loss_first_order" (snip.loss_first_order):
                         "abs"      (1/n) Σ_b |<G_b, e_Y,b>|                      (>= 0; the default)
                         "signed"   (1/n) Σ_b <G_b, e_Y,b>                        (a systematic gain counts)
                         "momentum" <m̂, Q(W)-W> + (1/n) Σ_b (<G_b, e_Y,b> - <dW_b, Q(W)-W>)
                                    (signed; the weight error's part, the same for every batch, priced
                                    with AdamW's momentum m̂ instead of the n probe gradients)
    weight divergence  ΔW(ℓ,f) = ΔW_wgrad + ΔW_dgrad, both relative to ‖u‖ = ‖ḡ ⊘ (√v̂+eps)‖, by the
                       snapshot's "weight_divergence" (snip.weight_divergence):
                         "norm"     ΔW_wgrad = ‖ē_dW(f) ⊘ (√v̂+eps)‖ / ‖u‖   (this layer's own update error)
                                    ΔW_dgrad = γ_ℓ · ‖ē_dX(f)‖ / ‖u‖        (error propagated to earlier layers)
                         "squared"  the squares of both: (‖·‖ / ‖u‖)²; squared norms of independent
                                    errors add, over the GEMMs the ILP sums and over the parameters
                                    an error reaches, as the excess loss from update noise does
                         "loss"     the squares, each priced in loss by the curvature of what it moves:
                                    ΔW_wgrad = c_ℓ · (‖ē_dW ⊘ (√v̂+eps)‖ / ‖u‖)²  (½ δᵀHδ of the update error δ
                                               through this layer's output, H ≈ κ_ℓ XᵀX, rows of δ isotropic),
                                    ΔW_dgrad = c̄ · (γ_ℓ‖ē_dX‖ / ‖u‖)²        (the error lands on earlier
                                               parameters, priced at the model's mean c)
                                    with c_ℓ = ½ max(κ_ℓ, 0) · sq_x / (tokens · K) and c̄ their mean weighted by
                                    each weight's entries (``loss_per_update``)

where κ_ℓ = curv_num / curv_den (Hutchinson, one-sided against the reference pass),
γ_ℓ = sqrt(num / den) of the propagation pass (preconditioned gain of a unit upstream
gradient), ḡ, ē the probe-mean gradient and errors.
Each metric is then divided by its total (of magnitudes) over all linears at the harshest
candidate format, so both are fractions of comparable size, and the cost of a GEMM is

    fprop: ΔL_norm,   dgrad: λ·ΔW_dgrad_norm,   wgrad: λ·ΔW_wgrad_norm.

A signed ΔL can be negative; the ILP takes costs >= 0 and picks one format per GEMM, so each
fprop's costs are shifted by their minimum over formats (which leaves the optimum unchanged).

``truth_costs`` puts measured divergences (``snip/truth.py``) into the same structure: the oracle
SNIP's estimates are judged against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_snip.precision.plan import GemmId


@dataclass(frozen=True)
class LinearDivergence:
    """Un-normalized divergences of one linear in one format."""

    loss_first_order: float
    loss_second_order: float
    weight_wgrad: float
    weight_dgrad: float

    @property
    def loss(self) -> float:
        return self.loss_first_order + self.loss_second_order

    @property
    def weight(self) -> float:
        return self.weight_wgrad + self.weight_dgrad


def curvature(s: Mapping[str, Any]) -> float:
    return s["curv_num"] / s["curv_den"] if s["curv_den"] > 0 else 0.0


def propagation_gain(snapshot: Mapping[str, Any], key: str) -> float:
    p = snapshot["propagation"].get(key, {"num": 0.0, "den": 0.0})
    return math.sqrt(p["num"] / p["den"]) if p["den"] > 0 else 0.0


def linear_divergences(snapshot: Mapping[str, Any]) -> dict[str, dict[str, LinearDivergence]]:
    """{"<layer>.<linear>": {format: LinearDivergence}} before normalization."""
    n = snapshot["num_probe_batches"] * snapshot.get("replicas", 1)
    update_norm = math.sqrt(snapshot["total_sq_update"]) or 1.0
    out: dict[str, dict[str, LinearDivergence]] = {}
    first_order = FIRST_ORDER[snapshot.get("loss_first_order", "abs")]
    mode = snapshot.get("weight_divergence", "norm")
    power = WEIGHT_POWER[mode]
    price = loss_per_update(snapshot) if mode == "loss" else None
    mean_price = _entry_weighted_mean(snapshot, price) if price is not None else 1.0
    for key, s in snapshot["linears"].items():
        kappa, gamma = max(curvature(s), 0.0), propagation_gain(snapshot, key)
        own_price = 1.0 if price is None else price[key]
        out[key] = {
            f: LinearDivergence(
                loss_first_order=first_order(pf, n),
                loss_second_order=0.5 * kappa * pf["sq_ey"] / n,
                weight_wgrad=own_price * (math.sqrt(pf["sq_edw_precond"]) / update_norm) ** power,
                weight_dgrad=mean_price * (gamma * math.sqrt(pf["sq_edx"]) / n / update_norm) ** power,
            )
            for f, pf in s["per_format"].items()
        }
    return out


# The first-order term of ΔL from one linear's per-format sums over n probe micro-batches (module docstring).
FIRST_ORDER = {
    "abs": lambda pf, n: pf["abs_grad_dot_ey"] / n,
    "signed": lambda pf, n: pf["grad_dot_ey"] / n,
    "momentum": lambda pf, n: pf["m_dot_ew"] + (pf["grad_dot_ey"] - pf["grad_dot_ew"]) / n,
}


# The weight divergence's power of the relative update error, by snip.weight_divergence (module docstring).
WEIGHT_POWER = {"norm": 1, "squared": 2, "loss": 2}


def loss_per_update(snapshot: Mapping[str, Any]) -> dict[str, float]:
    """{"<layer>.<linear>": c_ℓ}: the second-order loss change per unit squared error δ of linear ℓ's
    weight update, c_ℓ = ½ max(κ_ℓ, 0) · sq_x / (tokens · K) (``snip.weight_divergence = "loss"``).

    δ (N, K) moves the layer's output by X δᵀ (T, N); the loss changes by ½ κ_ℓ ‖X δᵀ‖² along it
    (κ_ℓ: the Hutchinson curvature per unit ‖δY‖² of one probe micro-batch, as ΔL's second-order term
    uses it), and for rows of δ with no preferred direction E‖X δᵀ‖² = ‖δ‖² · ‖X‖²_F / K = ‖δ‖² · T · x̄²,
    with x̄² = sq_x / (tokens · K) the mean squared input entry. The token count T of a micro-batch is
    the same for every linear and cancels in the normalization, so it is left out. sq_x and tokens
    are both summed over TP shards (and K is the shard's), so x̄² is the same at every TP degree."""
    out = {}
    for key, s in snapshot["linears"].items():
        entries = s["tokens"] * s["shape"][1]
        out[key] = 0.5 * max(curvature(s), 0.0) * (s["sq_x"] / entries if entries > 0 else 0.0)
    return out


def _entry_weighted_mean(snapshot: Mapping[str, Any], per_linear: Mapping[str, float]) -> float:
    """Mean of a per-linear quantity over the model's linear weight entries (N·K per linear)."""
    sizes = {k: s["shape"][0] * s["shape"][1] for k, s in snapshot["linears"].items()}
    total = sum(sizes.values())
    return sum(per_linear[k] * sizes[k] for k in sizes) / total if total > 0 else 0.0


def _normalizer(values: dict[str, dict[str, float]]) -> float:
    """Total magnitude over linears at the harshest format (the one with the largest total)."""
    formats = next(iter(values.values())).keys()
    total = max(sum(abs(v[f]) for v in values.values()) for f in formats)
    return total if total > 0 else 1.0


def snip_costs(snapshot: Mapping[str, Any], weight_divergence_weight: float = 1.0) -> dict[GemmId, dict[str, float]]:
    """Normalized cost of each GEMM in each format, for the ILP."""
    if snapshot.get("kind") == "truth":
        raise ValueError(f"the snapshot of step {snapshot.get('step')} holds measured divergences (a run of policy "
                         f"truth), not SNIP's statistics; its costs are snip.metrics.truth_costs (policy truth)")
    if not snapshot.get("noise_passes", True):
        raise ValueError(f"the statistics snapshot of step {snapshot.get('step')} was collected without the noise "
                         f"passes (as for policy min_rel_err), so it has no curvature or propagation gains; SNIP's "
                         f"divergences need them: use a snapshot from a run with snip.policy=snip")
    return divergence_costs(linear_divergences(snapshot), weight_divergence_weight)


def truth_costs(snapshot: Mapping[str, Any], weight_divergence_weight: float = 1.0) -> dict[GemmId, dict[str, float]]:
    """The ``truth`` policy's costs: SNIP's cost structure with the *measured* divergences of a
    ``snip.truth.measure`` snapshot (per-batch means) in place of the estimates: fprop ΔL (signed, the
    whole loss change, so no separate curvature term), dgrad and wgrad ΔW of that GEMM alone."""
    if snapshot.get("kind") != "truth":
        raise ValueError(f"the snapshot of step {snapshot.get('step')} holds SNIP's statistics, not measured "
                         f"divergences; the truth policy's costs need a snip.truth.measure snapshot")
    n = snapshot["num_batches"]
    div = {key: {f: LinearDivergence(loss_first_order=m["dl"] / n, loss_second_order=0.0,
                                     weight_wgrad=m["dw_wgrad"] / n, weight_dgrad=m["dw_dgrad"] / n)
                 for f, m in per_f.items()}
           for key, per_f in snapshot["linears"].items()}
    return divergence_costs(div, weight_divergence_weight)


def divergence_costs(div: Mapping[str, Mapping[str, LinearDivergence]],
                     weight_divergence_weight: float) -> dict[GemmId, dict[str, float]]:
    """Per-GEMM costs from per-linear divergences (module docstring: normalization and shift)."""
    loss = {k: {f: d.loss for f, d in v.items()} for k, v in div.items()}
    weight = {k: {f: d.weight for f, d in v.items()} for k, v in div.items()}
    zl, zw = _normalizer(loss), _normalizer(weight)
    lam = weight_divergence_weight
    costs: dict[GemmId, dict[str, float]] = {}
    for key, per_f in div.items():
        layer, linear = _split(key)
        floor = min(0.0, *(d.loss for d in per_f.values()))  # 0 unless a signed ΔL is negative
        costs[GemmId(layer, linear, "fprop")] = {f: (d.loss - floor) / zl for f, d in per_f.items()}
        costs[GemmId(layer, linear, "dgrad")] = {f: lam * d.weight_dgrad / zw for f, d in per_f.items()}
        costs[GemmId(layer, linear, "wgrad")] = {f: lam * d.weight_wgrad / zw for f, d in per_f.items()}
    return costs


def relative_error_costs(snapshot: Mapping[str, Any]) -> dict[GemmId, dict[str, float]]:
    """The local-error baseline: relative error of each GEMM's output in each format."""
    costs: dict[GemmId, dict[str, float]] = {}
    for key, s in snapshot["linears"].items():
        layer, linear = _split(key)
        pfs = s["per_format"]
        costs[GemmId(layer, linear, "fprop")] = {f: _rel(pf["sq_ey"], s["sq_y"]) for f, pf in pfs.items()}
        costs[GemmId(layer, linear, "dgrad")] = {f: _rel(pf["sq_edx"], s["sq_dx"]) for f, pf in pfs.items()}
        costs[GemmId(layer, linear, "wgrad")] = {f: _rel(pf["sq_edw"], s["sq_dw"]) for f, pf in pfs.items()}
    return costs


def predicted_divergence(costs: Mapping[GemmId, Mapping[str, float]], assignment: Mapping[GemmId, str]) -> float:
    """Σ cost of the assigned formats - the ILP objective of an assignment."""
    return sum(costs[g][f] for g, f in assignment.items() if g in costs)


def _rel(sq_err: float, sq_ref: float) -> float:
    return math.sqrt(sq_err / sq_ref) if sq_ref > 0 else 0.0


def _split(key: str) -> tuple[int, str]:
    layer, linear = key.split(".")
    return int(layer), linear
