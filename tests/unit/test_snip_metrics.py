"""SNIP statistics and metrics on small problems whose answer is known in closed form.

The "model" is one or two PrecisionLinears with a quadratic loss
L = c/2 · ‖Y − X·Aᵀ‖², whose Hessian in Y is c·I: the Hutchinson curvature must be c, and
first- plus second-order Taylor terms must reproduce the true loss change of a quantized fprop
exactly. Weight divergences are checked against hand-computed AdamW-preconditioned errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_snip.model.layers import PrecisionLinear
from megatron_snip.parallel.topology import ParallelTopology
from megatron_snip.precision.backends.emulated import EmulatedBackend
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.plan import GemmId, GemmPrecision
from megatron_snip.precision.quantize import quantize
from megatron_snip.snip import stats as stats_module
from megatron_snip.snip.adam_moments import adam_denominator
from megatron_snip.snip.metrics import (
    curvature,
    linear_divergences,
    loss_per_update,
    propagation_gain,
    relative_error_costs,
    snip_costs,
)
from megatron_snip.snip.policies import policy_costs
from megatron_snip.snip.stats import ProbeConfig, StatsCollector

T, K, H, N = 128, 32, 32, 32
C = 3.0


class Chain(nn.Module):
    def __init__(self, two: bool, residual: bool = False) -> None:
        super().__init__()
        self.residual = residual  # y = fc2(h) + h: fc2's input then has a second consumer
        self.lins = nn.ModuleList()
        if two:
            self.lins.append(PrecisionLinear(K, H, layer=0, linear="fc1", init_std=0.2))
        self.lins.append(PrecisionLinear(H if two else K, N, layer=0, linear="fc2", init_std=0.2))

    def precision_linears(self):
        return iter(self.lins)

    def forward(self, x):
        for lin in self.lins:
            x = lin(x) + (x if self.residual and lin.linear == "fc2" else 0.0)
        return x


class QuadraticTrainer:
    """A ``ProbeHost`` (snip/host.py): what StatsCollector needs of its host."""

    def __init__(self, two: bool = False, seed: int = 0, residual: bool = False) -> None:
        torch.manual_seed(seed)
        self.num_layers = 1
        self.topo = ParallelTopology.single()
        self.device = torch.device("cpu")
        self.model = Chain(two, residual)
        self.target_map = torch.randn(N, K) * 0.3
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def forward_loss(self, x):
        y = self.model(x)
        return 0.5 * C * (y - x @ self.target_map.t()).pow(2).sum()

    def forward_backward(self, micro):
        total = torch.zeros(())
        for x in micro:
            loss = self.forward_loss(x)
            loss.backward()
            total += loss.detach()
        return total

    def set_adam_state(self, v_hat: float, step: int = 10) -> None:
        """AdamW state whose bias-corrected √v̂ is ``sqrt(v_hat)`` everywhere."""
        beta2 = self.optimizer.param_groups[0]["betas"][1]
        for p in self.model.parameters():
            self.optimizer.state[p] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(p),
                                       "exp_avg_sq": torch.full_like(p, v_hat * (1 - beta2**step))}


def test_the_stand_in_is_a_probe_host():
    from megatron_snip.snip.host import ProbeHost

    assert isinstance(QuadraticTrainer(), ProbeHost)


def collect(trainer, formats, batches, draws=2):
    return StatsCollector(ProbeConfig(formats=formats, noise_draws=draws, seed=0)).collect(trainer, batches, step=1)


def test_curvature_is_exact_for_quadratic_loss():
    tr = QuadraticTrainer()
    snap = collect(tr, ("fp8", "nvfp4"), [torch.randn(T, K)])
    assert curvature(snap["linears"]["0.fc2"]) == pytest.approx(C, rel=1e-4)


class Bf16QuadraticTrainer(QuadraticTrainer):
    """The stand-in under bf16 autocast, as training runs on a GPU: Y comes out in bf16 and the
    loss L = c/2·‖Y‖² is taken in fp32. With c a power of two, G = c·Y is exact in bf16, so a
    perturbation δ of Y changes G by exactly c·δ: the curvature along the perturbation made is c."""

    C_POW2 = 4.0

    def forward_loss(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.model(x)
        return 0.5 * self.C_POW2 * y.float().pow(2).sum()


def test_curvature_under_bf16_prices_the_perturbation_it_made():
    """#22 item 8: under autocast the forward noise ε (fp32) is rounded with Y into bf16, so Y moves by
    δ ≠ ε. The Hutchinson sums must pair the gradient change c·δ with δ itself; summing ⟨ε, c·δ⟩/‖ε‖²
    (what the pass did before) misses c by the rounding's share. With c a power of two every product
    and partial sum of the numerator is exactly c times the denominator's (fp32 and fp64 rounding
    commute with scaling by 2^k), so κ = c up to fp64 rounding of the final division."""
    tr = Bf16QuadraticTrainer()
    snap = collect(tr, ("fp8",), [torch.randn(T, K), torch.randn(T, K)])
    assert snap["linears"]["0.fc2"]["curv_den"] > 0
    assert curvature(snap["linears"]["0.fc2"]) == pytest.approx(tr.C_POW2, rel=1e-12)


def test_forward_noise_pass_reports_the_perturbation_bf16_made():
    """Noise below half a bf16 ulp of Y vanishes in the sum: the pass reports δ = 0 there, and
    elsewhere δ is ε rounded with Y, bit-exactly what Y moved by."""
    tr = Bf16QuadraticTrainer()
    x = torch.randn(T, K)
    collector = StatsCollector(ProbeConfig(formats=("fp8",)))
    g0, none = collector.noisy_output_grads(tr, x, None)
    assert none == {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = tr.model(x)
    eps = torch.randn(T, N) * float(y.float().abs().mean()) * 2.0**-8  # about a bf16 ulp of Y
    g, delta = collector.noisy_output_grads(tr, x, {"0.fc2": eps})
    expected = (y + eps.to(torch.bfloat16)).double() - y.double()
    assert torch.equal(delta["0.fc2"], expected.float())
    assert (delta["0.fc2"] == 0).any() and not torch.equal(delta["0.fc2"], eps)
    assert torch.equal(g["0.fc2"] - g0["0.fc2"], tr.C_POW2 * delta["0.fc2"])


class AnisotropicTrainer(QuadraticTrainer):
    """L = ½ Σ_t Σ_j c_j (Y_tj − (X·Aᵀ)_tj)²: the Hessian in Y is diag(c) per token, with c spread
    over two decades and growing with the row norm of W, so the quantization error (larger in the
    columns of larger W rows) lies along the high-curvature columns, not isotropically."""

    def __init__(self) -> None:
        super().__init__()
        scale = torch.logspace(-1, 1, N)  # row j of W and c_j grow together
        with torch.no_grad():
            self.model.lins[0].weight.mul_(scale.sqrt()[:, None])
        self.c = scale

    def forward_loss(self, x):
        y = self.model(x)
        return 0.5 * ((y - x @ self.target_map.t()).pow(2) * self.c).sum()


@pytest.mark.parametrize("noise", ["gaussian", "error"])
def test_error_direction_curvature_prices_the_error_exactly(noise):
    """With the noise along the harshest format's own error (curvature_noise="error"), κ·‖e‖² is
    eᵀHe, so first- plus second-order terms reproduce that format's true loss change of a quadratic
    loss exactly (up to fp32 rounding of the sums, ~1e-6 relative); isotropic noise measures the mean
    of c instead, which misprices an error concentrated in the high-curvature columns."""
    tr = AnisotropicTrainer()
    x = torch.randn(T, K)
    snap = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=2, curvature_noise=noise)).collect(
        tr, [x], step=1)
    s, pf = snap["linears"]["0.fc2"], snap["linears"]["0.fc2"]["per_format"]["nvfp4"]
    predicted = pf["grad_dot_ey"] + 0.5 * curvature(s) * pf["sq_ey"]
    lin = tr.model.lins[0]
    with torch.no_grad():
        base = float(tr.forward_loss(x))
        lin.set_precision(GemmPrecision(fprop="nvfp4"))
        true = float(tr.forward_loss(x)) - base
    if noise == "error":
        assert predicted == pytest.approx(true, rel=1e-4)
    else:  # the isotropic estimate is off by far more than its sampling noise here
        assert abs(predicted - true) > 0.1 * abs(true - pf["grad_dot_ey"])


def test_probe_config_and_snip_config_reject_unknown_estimator_modes():
    from megatron_snip.config import load_config

    with pytest.raises(ValueError, match="curvature_noise"):
        ProbeConfig(formats=("fp8",), curvature_noise="uniform")
    with pytest.raises(ValueError, match="loss_first_order"):
        ProbeConfig(formats=("fp8",), loss_first_order="none")
    with pytest.raises(ValueError, match="weight_divergence"):
        ProbeConfig(formats=("fp8",), weight_divergence="cubed")
    for key in ("curvature_noise", "loss_first_order", "weight_divergence"):
        with pytest.raises(ValueError, match=f"snip.{key}='x'"):
            load_config("launch/configs/tiny.toml", [f'snip.{key}="x"'])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_taylor_terms_reproduce_true_loss_change(fmt):
    tr = QuadraticTrainer()
    x = torch.randn(T, K)
    snap = collect(tr, (fmt,), [x])
    s = snap["linears"]["0.fc2"]
    predicted = s["per_format"][fmt]["grad_dot_ey"] + 0.5 * curvature(s) * s["per_format"][fmt]["sq_ey"]
    lin = tr.model.lins[0]
    with torch.no_grad():
        base = float(tr.forward_loss(x))
        lin.set_precision(GemmPrecision(fprop=fmt))
        true = float(tr.forward_loss(x)) - base
    assert predicted == pytest.approx(true, rel=1e-3, abs=1e-6)
    # The metric prices |first order| + curvature term: never below the true change.
    d = linear_divergences(snap)["0.fc2"][fmt]
    assert d.loss >= true - 1e-3 * abs(true) and d.loss == pytest.approx(abs(s["per_format"][fmt]["grad_dot_ey"])
                                                            + 0.5 * C * s["per_format"][fmt]["sq_ey"], rel=1e-3)


def test_wgrad_weight_divergence_matches_hand_computed_adam_error():
    tr = QuadraticTrainer()
    tr.set_adam_state(v_hat=0.04)
    x = torch.randn(T, K)
    snap = collect(tr, ("fp8",), [x])
    w = tr.model.lins[0].weight.detach()
    g = C * (x @ w.t() - x @ tr.target_map.t())  # dL/dY, (T, N)
    dw = g.t() @ x
    # fp8 wgrad: G (E5M2) and X (E4M3), both blocked along tokens: quantize their transposes.
    dw_q = quantize(g.t().contiguous(), "fp8", Operand.GRADIENT) @ quantize(x.t().contiguous(), "fp8", Operand.ACTIVATION).t()
    denom = math.sqrt(0.04) + 1e-8
    expected = float(((dw_q - dw) / denom).norm() / (dw / denom).norm())
    assert linear_divergences(snap)["0.fc2"]["fp8"].weight_wgrad == pytest.approx(expected, rel=1e-4)


def test_weight_error_first_order_sums_match_hand_computed():
    """grad_dot_ew = Σ_b <G_bᵀX_b, Q(W) − W> (the weight error's part of <G, e_Y>) and m_dot_ew =
    <m̂, Q(W) − W> with AdamW's bias-corrected first moment; fp32 sums of 1024 products, rel 1e-4."""
    tr = QuadraticTrainer()
    tr.set_adam_state(v_hat=0.04, step=10)
    lin = tr.model.lins[0]
    m = torch.randn_like(lin.weight)
    tr.optimizer.state[lin.weight]["exp_avg"] = m.clone()
    batches = [torch.randn(T, K), torch.randn(T, K)]
    snap = collect(tr, ("fp8", "nvfp4"), batches)
    w = lin.weight.detach()
    beta1 = tr.optimizer.param_groups[0]["betas"][0]
    for fmt in ("fp8", "nvfp4"):
        e_w = quantize(w, fmt, Operand.WEIGHT) - w
        grad = sum((C * (x @ w.t() - x @ tr.target_map.t())).t() @ x for x in batches)
        pf = snap["linears"]["0.fc2"]["per_format"][fmt]
        assert pf["grad_dot_ew"] == pytest.approx(float((grad * e_w).sum()), rel=1e-4)
        assert pf["m_dot_ew"] == pytest.approx(float((m / (1 - beta1**10) * e_w).sum()), rel=1e-4)


def test_propagation_gain_matches_jacobian_norm():
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=(1 - 1e-8) ** 2)  # √v̂ + eps == 1: no preconditioning
    x = torch.randn(T, K)
    snap = StatsCollector(ProbeConfig(formats=("fp8",), noise_draws=1, propagation_sequences=T)).collect(tr, [x], 1)
    # Upstream noise ε (T, H) at fc2's input reaches only fc1's weight: δ = εᵀ·X, so
    # E‖δ‖² / E‖ε‖² = ‖X‖² / T. One draw of T·H = 4096 normals concentrates within a few %.
    assert propagation_gain(snap, "0.fc2") == pytest.approx(float(x.norm()) / math.sqrt(T), rel=0.1)
    assert propagation_gain(snap, "0.fc1") == 0.0  # its input is the data: nothing upstream


def test_normalized_costs_and_baseline_costs():
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=0.01)
    snap = collect(tr, ("bf16", "fp8", "nvfp4"), [torch.randn(T, K), torch.randn(T, K)])
    costs = snip_costs(snap, weight_divergence_weight=2.0)
    assert set(costs) == {GemmId(0, lin, g) for lin in ("fc1", "fc2") for g in ("fprop", "dgrad", "wgrad")}
    for g, per_f in costs.items():
        assert per_f["bf16"] == 0.0
        assert per_f["nvfp4"] > per_f["fp8"] > 0.0 or (g.gemm == "dgrad" and g.linear == "fc1")
    fprop_total = sum(c["nvfp4"] for g, c in costs.items() if g.gemm == "fprop")
    weight_total = sum(c["nvfp4"] for g, c in costs.items() if g.gemm != "fprop")
    assert fprop_total == pytest.approx(1.0) and weight_total == pytest.approx(2.0)  # λ = 2
    rel = relative_error_costs(snap)
    assert all(c["bf16"] == 0.0 and c["nvfp4"] > c["fp8"] > 0 for c in rel.values())
    assert snap["linears"]["0.fc1"]["per_format"]["nvfp4"]["sq_qerr_w"] > 0


def test_squared_weight_divergence_squares_both_parts_and_leaves_the_loss_alone():
    """snip.weight_divergence="squared": ΔW_wgrad and ΔW_dgrad are the squares of the "norm" ones
    (relative update errors), computed from the same sums; ΔL is unchanged; a snapshot without the
    field (written before it existed) reads as "norm"."""
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=0.01)
    snap = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, weight_divergence="squared")).collect(
        tr, [torch.randn(T, K)], step=1)
    assert snap["weight_divergence"] == "squared"
    squared = linear_divergences(snap)
    norm = linear_divergences({**snap, "weight_divergence": "norm"})
    legacy = dict(snap)
    del legacy["weight_divergence"]
    assert linear_divergences(legacy) == norm
    for key, per_f in squared.items():
        for f, d in per_f.items():
            n = norm[key][f]
            assert d.loss == n.loss
            assert d.weight_wgrad == n.weight_wgrad ** 2 and d.weight_dgrad == n.weight_dgrad ** 2
            assert n.weight_wgrad > 0
    assert norm["0.fc2"]["nvfp4"].weight_dgrad > 0  # fc1, the first linear, has no earlier parameters
    # The ILP's costs: the squares, normalized by their own total at the harshest format.
    costs = snip_costs(snap)
    wgrad = {g: c for g, c in costs.items() if g.gemm == "wgrad"}
    total = max(sum(d[f].weight for d in squared.values()) for f in ("fp8", "nvfp4"))
    g = GemmId(0, "fc2", "wgrad")
    assert wgrad[g]["nvfp4"] == pytest.approx(squared["0.fc2"]["nvfp4"].weight_wgrad / total, rel=1e-12)


def test_loss_weight_divergence_prices_the_squares_by_curvature_and_input():
    """snip.weight_divergence="loss": ΔW_wgrad is the "squared" one times c_ℓ = ½κ·sq_x/(tokens·K), and
    ΔW_dgrad the "squared" one times the entry-weighted mean of c over the model's linears; ΔL is
    unchanged and the costs are normalized by their own total at the harshest format."""
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=0.01)
    snap = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, weight_divergence="loss")).collect(
        tr, [torch.randn(T, K), torch.randn(T, K)], step=1)
    loss = linear_divergences(snap)
    squared = linear_divergences({**snap, "weight_divergence": "squared"})
    lins = snap["linears"]
    price = {k: 0.5 * max(curvature(s), 0.0) * s["sq_x"] / (s["tokens"] * s["shape"][1]) for k, s in lins.items()}
    assert loss_per_update(snap) == pytest.approx(price, rel=1e-12)
    assert price["0.fc2"] > 0 and price["0.fc1"] > 0 and price["0.fc1"] != pytest.approx(price["0.fc2"])
    size = {k: s["shape"][0] * s["shape"][1] for k, s in lins.items()}
    mean = sum(price[k] * size[k] for k in lins) / sum(size.values())
    for key, per_f in loss.items():
        for f, d in per_f.items():
            sq = squared[key][f]
            assert d.loss == sq.loss
            assert d.weight_wgrad == pytest.approx(price[key] * sq.weight_wgrad, rel=1e-12)
            assert d.weight_dgrad == pytest.approx(mean * sq.weight_dgrad, rel=1e-12)
    assert loss["0.fc2"]["nvfp4"].weight_dgrad > 0
    costs = snip_costs(snap)
    total = max(sum(d[f].weight for d in loss.values()) for f in ("fp8", "nvfp4"))
    assert costs[GemmId(0, "fc1", "wgrad")]["nvfp4"] == pytest.approx(loss["0.fc1"]["nvfp4"].weight_wgrad / total,
                                                                      rel=1e-12)


def test_loss_per_update_is_the_mean_loss_change_of_a_weight_error_over_directions():
    """c_ℓ·T·‖δ‖² is the second-order loss change ½δᵀHδ of a weight error δ averaged over the
    directions of its rows: here H = C·XᵀX ⊗ I exactly (L = C/2‖Y − XAᵀ‖²), and one row of δ along each
    unit vector of K in turn gives the mean of ½C‖Xδᵀ‖² = ½C‖X e_i‖² over i, ½C‖X‖²_F / K. The only
    inexact factor is the Hutchinson κ (within 1e-4 of C, test_curvature_is_exact_for_quadratic_loss)."""
    tr = QuadraticTrainer()
    x = torch.randn(T, K) * torch.linspace(0.2, 3.0, K)  # anisotropic inputs: the average over directions matters
    snap = collect(tr, ("fp8", "nvfp4"), [x])
    exact = [0.5 * C * (x @ torch.eye(K)[i]).pow(2).sum().item() for i in range(K)]  # δ = e_iᵀ in row 0
    assert loss_per_update(snap)["0.fc2"] * T == pytest.approx(sum(exact) / K, rel=1e-4)


def test_loss_per_update_does_not_depend_on_the_tp_degree():
    """Per-linear sums are added over TP shards: a column-parallel shard sees all of X (sq_x and tokens
    both count once per shard), a row-parallel one a K/tp slice (sq_x splits, K shrinks, tokens count
    per shard). Either way sq_x / (tokens · K) is the mean squared input entry of the whole linear."""
    s = {"tokens": 256, "shape": [64, 32], "sq_x": 500.0, "curv_num": 6.0, "curv_den": 2.0}
    whole = loss_per_update({"linears": {"0.qkv": s}})["0.qkv"]
    tp = 4
    column = {**s, "tokens": tp * 256, "shape": [64 // tp, 32], "sq_x": tp * 500.0}
    row = {**s, "tokens": tp * 256, "shape": [64, 32 // tp], "sq_x": 500.0}
    for shard in (column, row):
        assert loss_per_update({"linears": {"0.qkv": shard}})["0.qkv"] == pytest.approx(whole, rel=1e-15)
    negative = {**s, "curv_num": -6.0}  # a negative curvature estimate prices nothing, as in ΔL
    assert loss_per_update({"linears": {"0.qkv": negative}})["0.qkv"] == 0.0


@pytest.mark.parametrize("mode", ["signed", "momentum"])
def test_signed_loss_divergence_keeps_costs_non_negative_and_their_differences(mode):
    """A signed first-order term can make ΔL negative; the fprop costs are shifted per GEMM so that
    they are >= 0 for the ILP, with the differences between formats (what the ILP trades) intact."""
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=0.01)
    snap = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, loss_first_order=mode)).collect(
        tr, [torch.randn(T, K)], step=1)
    assert snap["loss_first_order"] == mode
    div = linear_divergences(snap)
    pf = snap["linears"]["0.fc2"]["per_format"]["nvfp4"]
    first = pf["grad_dot_ey"] if mode == "signed" else pf["m_dot_ew"] + pf["grad_dot_ey"] - pf["grad_dot_ew"]
    assert div["0.fc2"]["nvfp4"].loss_first_order == pytest.approx(first, rel=1e-12)
    # make one linear's ΔL negative in both formats, as a systematic first-order gain does
    for f in ("fp8", "nvfp4"):
        p = snap["linears"]["0.fc1"]["per_format"][f]
        p["grad_dot_ey"] = p["grad_dot_ew"] = p["m_dot_ew"] = -1e3 * (1 + p["sq_ey"])
    div = linear_divergences(snap)
    assert div["0.fc1"]["nvfp4"].loss < 0 and div["0.fc1"]["fp8"].loss < 0
    costs = snip_costs(snap)
    zl = sum(abs(div[k]["nvfp4"].loss) for k in div)
    for key, layer_linear in (("0.fc1", "fc1"), ("0.fc2", "fc2")):
        c = costs[GemmId(0, layer_linear, "fprop")]
        assert min(c.values()) >= 0.0
        assert c["nvfp4"] - c["fp8"] == pytest.approx((div[key]["nvfp4"].loss - div[key]["fp8"].loss) / zl, rel=1e-9)


def test_errors_only_collection_matches_the_full_one_and_is_refused_by_snip():
    """min_rel_err's statistics (pass 1 only) equal the full collection's errors; snip refuses them."""
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(0.01)
    batches = [torch.randn(T, K), torch.randn(T, K)]
    collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, seed=0))
    full = collector.collect(tr, batches, step=1)
    errors_only = collector.collect(tr, batches, step=1, noise_passes=False)
    assert full["noise_passes"] and not errors_only["noise_passes"]
    assert all(p.requires_grad for p in tr.model.parameters())  # the noise pass's frozen weights are restored
    assert errors_only["propagation"] == {}
    assert set(errors_only["timings"]) == {"reference_pass_s"}
    assert relative_error_costs(errors_only) == relative_error_costs(full)
    for key, s in errors_only["linears"].items():
        assert s["curv_den"] == 0.0 and full["linears"][key]["curv_den"] > 0
        assert s["per_format"] == full["linears"][key]["per_format"]
    with pytest.raises(ValueError, match="without the noise passes"):
        snip_costs(errors_only)
    # the controller and the offline planner pick costs by policy through one function
    assert policy_costs("min_rel_err", errors_only) == relative_error_costs(errors_only)
    assert policy_costs("snip", full, 2.0) == snip_costs(full, 2.0)
    with pytest.raises(ValueError, match="takes no costs"):
        policy_costs("random", full)


def _small_trainer(overrides):
    from megatron_snip.config import load_config
    from megatron_snip.training.trainer import Trainer

    tr = Trainer(load_config("launch/configs/tiny.toml", overrides))
    for step in range(2):  # AdamW state exists: the gains are preconditioned by its v
        tr.train_step(step)
    return tr


def test_propagation_by_vjp_equals_the_rerun_difference(small_overrides, monkeypatch):
    """One pipeline stage: J·ε as a vector-Jacobian product (one forward) equals the difference
    of whole backward passes with and without ε (the path pipelined layouts take), same ε."""
    tr = _small_trainer(small_overrides)
    tokens = tr.micro_batches(10)[0]
    collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, propagation_sequences=2))
    by_vjp = collector.collect(tr, [tokens], step=3)
    monkeypatch.setattr(collector, "_propagation_by_vjp", collector._propagation_by_reruns)
    by_reruns = collector.collect(tr, [tokens], step=3)
    assert sorted(by_vjp["propagation"]) == sorted(by_reruns["propagation"])
    for key, got in by_vjp["propagation"].items():
        want = by_reruns["propagation"][key]
        assert got["den"] == want["den"] > 0, key  # the same noise was injected
        assert got["num"] == pytest.approx(want["num"], rel=1e-3) and got["num"] > 0, key
    assert by_vjp["linears"] == by_reruns["linears"]  # passes 1 and 2 are untouched


class _ParameterOnlyBackend(EmulatedBackend):
    """Transformer Engine's constraints without a GPU: it runs only the layer's own weight
    Parameter (installed in a te.Linear) and one backward per graph."""

    name = "parameter_only"
    repeatable_backward = False

    def linear(self, x, weight, precision, **kw):
        if not isinstance(weight, nn.Parameter):
            raise TypeError("needs the weight as an nn.Parameter")
        return super().linear(x, weight, precision, **kw)


def test_statistics_run_with_a_backend_that_takes_only_the_layer_parameter(monkeypatch):
    """The measured errors come from the emulated formats whatever the training backend (TE
    could not run GEMMs on a detached weight), and a backend that allows one backward per graph
    gets the propagation gains by reruns, not VJPs: the snapshot equals the emulated one."""
    from megatron_snip.precision.backends.te import TEBackend

    assert EmulatedBackend.repeatable_backward and not TEBackend.repeatable_backward
    batches = [torch.randn(T, K)]
    snaps = []
    for backend in (EmulatedBackend(), _ParameterOnlyBackend()):
        tr = QuadraticTrainer(two=True)
        tr.set_adam_state(0.01)
        for lin in tr.model.lins:
            lin.backend = backend
        collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, propagation_sequences=T))
        if not backend.repeatable_backward:
            monkeypatch.setattr(collector, "_propagation_by_vjp", lambda *a, **k: pytest.fail("took the VJP path"))
        snaps.append(collector.collect(tr, batches, step=1))
    emulated, parameter_only = snaps
    assert parameter_only["linears"] == emulated["linears"]
    for key, p in parameter_only["propagation"].items():  # reruns vs VJP: the same ε, fp32 rounding apart
        assert p["den"] == emulated["propagation"][key]["den"]
        assert p["num"] == pytest.approx(emulated["propagation"][key]["num"], rel=1e-4)


def test_reference_pass_reuses_y_and_dx_only_as_the_recomputation_would(monkeypatch):
    """Pass 1 takes Y and the GEMM's own dX from the probe pass; the measured errors equal those
    computed from freshly recomputed fp32 references. fc2's X also feeds a residual here, so X's
    total gradient differs from fc2's own dX - the probe must isolate the latter."""
    tr = QuadraticTrainer(two=True, residual=True)
    tr.set_adam_state(0.01)
    batches = [torch.randn(T, K)]
    collector = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, seed=0))
    kept = set()

    class Spy(stats_module._Record):  # notes that the probe did keep Y and dX
        def __setattr__(self, name, value):
            if name in ("y", "dx") and value is not None:
                kept.add(name)
            super().__setattr__(name, value)

    class NoReuse(stats_module._Record):  # drops Y and dX as the probe sets them: pass 1 recomputes both
        def __setattr__(self, name, value):
            super().__setattr__(name, None if name in ("y", "dx") else value)

    monkeypatch.setattr(stats_module, "_Record", Spy)
    reused = collector.collect(tr, batches, step=1, noise_passes=False)
    assert kept == {"y", "dx"}
    monkeypatch.setattr(stats_module, "_Record", NoReuse)
    recomputed = collector.collect(tr, batches, step=1, noise_passes=False)
    for key, s in reused["linears"].items():
        for f, pf in s["per_format"].items():
            for name, value in pf.items():
                assert value == pytest.approx(recomputed["linears"][key]["per_format"][f][name], rel=1e-5, abs=1e-9), (key, f, name)


def test_the_with_probe_preconditioner_changes_only_the_preconditioned_sums():
    """snip.preconditioner="with_probe" on an AdamW state with a tiny v̂ (a gradient far above its
    history): the update norm is the probe gradient over AdamW's next √v̂ (``adam_denominator`` with
    the gradient folded in), bounded by 1/√(1-β2) per element, where "stored" is 10^4 times larger;
    the sums that do not divide by √v̂ are bit-identical."""
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(4))
    snaps = {}
    for mode in ("stored", "with_probe"):
        tr = QuadraticTrainer(two=True)
        tr.set_adam_state(v_hat=1e-10)
        snaps[mode] = StatsCollector(ProbeConfig(formats=("fp8", "nvfp4"), noise_draws=1, preconditioner=mode)).collect(
            tr, [x], step=1)
    tr = QuadraticTrainer(two=True)
    tr.set_adam_state(v_hat=1e-10)
    tr.forward_backward([x])
    params = [p for p in tr.model.parameters() if p.grad is not None]
    want = sum(float((p.grad / adam_denominator(tr.optimizer, p, p.grad, with_grad=True)).pow(2).sum())
               for p in params)
    got = snaps["with_probe"]["total_sq_update"]
    assert got == pytest.approx(want, rel=1e-6)  # the same per-tensor fp32 sums; only their few additions differ
    beta2 = tr.optimizer.param_groups[0]["betas"][1]
    assert got <= sum(p.numel() for p in params) / (1 - beta2)
    assert snaps["stored"]["total_sq_update"] > 1e4 * got
    for key, s in snaps["stored"]["linears"].items():
        t = snaps["with_probe"]["linears"][key]
        assert s["sq_dw"] == t["sq_dw"] and s["sq_dw_precond"] != t["sq_dw_precond"]
        for f, pf in s["per_format"].items():
            for name in ("sq_ey", "sq_edx", "sq_edw", "abs_grad_dot_ey", "sq_qerr_w"):
                assert pf[name] == t["per_format"][f][name], (key, f, name)
            assert pf["sq_edw_precond"] != t["per_format"][f]["sq_edw_precond"]
    with pytest.raises(ValueError, match="snip.preconditioner='next'"):
        ProbeConfig(formats=("fp8",), preconditioner="next")
