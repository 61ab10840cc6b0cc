"""SNIP statistics: what each linear's GEMMs would lose in each candidate format.

Collected on probe micro-batches at a step boundary, with every GEMM temporarily in
BF16 (the reference trajectory). Three passes (docs/snip.md derives what each feeds):

1. **Reference pass** - one forward+backward per probe micro-batch. Each linear
   records X (T, K), its output Y (T, N) and G = dL/dY (T, N); with W (N, K) the
   errors of all three GEMMs in every candidate format are *measured* by running
   the quantized GEMM (``quant_linear``, the emulated formats) on the stored tensors:
   e_Y = Q(X)Q(W)ᵀ - XWᵀ, e_dX = Q(G)Q(W) - GW, e_dW = Q(G)ᵀQ(X) - GᵀX.
2. **Forward-noise pass** - Gaussian noise ε (fp32) added to every linear's Y at once, in Y's
   dtype; with δ the perturbation that made (ε rounded with Y: bf16 under autocast), the change of
   G against the reference pass gives the curvature κ ≈ <δ, G(ε) - G(0)> / ‖δ‖² (Hutchinson; the
   cross-terms between layers and the third-order term have zero mean).
3. **Backward-noise pass** - for each linear, Gaussian noise ε as the upstream
   gradient of its input X, back-propagated to every earlier parameter (exact:
   backprop is linear in the upstream gradient, so the change is the
   vector-Jacobian product J·ε, J = ∂X/∂θ); preconditioned by AdamW's √v̂ it gives
   the propagation gain γ = ‖J·ε ⊘ (√v̂+eps)‖ / ‖ε‖.

Every quantity is stored as an *additive* sum (squared norms, dot products,
numerators and denominators) so that snapshots can be summed over TP shards and DP
replicas before ``snip/metrics.py`` turns them into divergences. A snapshot is a
plain JSON-serializable dict (``StatsSnapshot``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_snip.config import CURVATURE_NOISE, LOSS_FIRST_ORDER, PRECONDITIONERS, WEIGHT_DIVERGENCE
from megatron_snip.model.layers import ColumnParallelLinear, PrecisionLinear
from megatron_snip.model.recompute import keep_intermediates
from megatron_snip.parallel.ddp import counted_once
from megatron_snip.precision.plan import LINEARS, GemmPrecision
from megatron_snip.snip.adam_moments import (
    adam_denominator,
    adam_steps,
    add_adam_norms,
    add_momentum_first_order,
)
from megatron_snip.snip.device_sums import DeviceSums
from megatron_snip.snip.host import ProbeHost, ReferencePass
from megatron_snip.snip.measure import operand_error_t, quantized_gemms, weight_error

BF16 = GemmPrecision()

# Keys of the per-format additive sums (see metrics.py for how each is used).
PER_FORMAT_KEYS = (
    "grad_dot_ey",  # sum_b <G_b, e_Y,b>            (signed first-order loss change, per batch)
    "grad_dot_ew",  # sum_b <dW_b, Q(W)-W>           (its weight-error part: <G_b, X_b (Q(W)-W)ᵀ>)
    "m_dot_ew",  # <m̂, Q(W)-W>, m̂ = AdamW's bias-corrected first moment (the same part, from ~1/(1-β1) steps' gradients)
    "abs_grad_dot_ey",  # sum_b |<G_b, e_Y,b>|
    "sq_ey",  # sum_b ‖e_Y,b‖²
    "sq_edx",  # sum_b ‖e_dX,b‖²
    "sq_edw",  # ‖sum_b e_dW,b‖² (error of the probe-batch gradient)
    "sq_edw_precond",  # ‖(sum_b e_dW,b)/n ⊘ (√v̂+eps)‖²  (wgrad update error, AdamW-preconditioned)
    "sq_qerr_x",  # sum_b ‖Q(X)-X‖²  (operand errors, fprop blocking)
    "sq_qerr_w",  # ‖Q(W)-W‖²
    "sq_qerr_g",  # sum_b ‖Q(G)-G‖²  (dgrad blocking)
)


@dataclass
class _Record:
    """Per-linear scratch for one probe micro-batch."""

    x: torch.Tensor | None = None  # (T, K) input; detached, except in mode "inputs" (pass 3 differentiates it)
    g: torch.Tensor | None = None  # (T, N) dL/dY
    y: torch.Tensor | None = None  # (T, N) reference output, kept when fp32 (pass 1 reuses it)
    dx: torch.Tensor | None = None  # (T, K) this GEMM's own dgrad G·W, kept when fp32 (pass 1 reuses it)
    noise: torch.Tensor | None = None  # (T, N) forward noise of the current draw (pass 2), fp32
    noise_realized: torch.Tensor | None = None  # (T, N) fp32: what the noise actually changed Y by (pass 2)
    grad_noise_sigma: float = 0.0  # > 0: add N(0, σ²) to the gradient of X (pass 3)
    grad_noise_sq: list[torch.Tensor] | None = None  # ‖ε‖² of each injected gradient noise (0-d, on the device)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).float()


@dataclass
class ProbeConfig:
    formats: tuple[str, ...]
    noise_draws: int = 2
    propagation_sequences: int = 1  # sequences of the first probe micro-batch used by pass 3
    seed: int = 0
    compiled_quantizers: bool = False  # precision.compile_quantizers: the mode of the error measurements' quantizers
    # Direction of pass 2's noise: "gaussian" (isotropic, σ of the harshest format's error: the mean
    # curvature along Y) or "error" (±e_Y(harshest) of the same batch, a random sign per linear and
    # draw: the curvature along the error being priced). See forward_noise.
    curvature_noise: str = "gaussian"
    # How snip/metrics.py reads the first-order sums (stamped into the snapshot as "loss_first_order").
    loss_first_order: str = "abs"
    # How snip/metrics.py measures an update error (stamped into the snapshot as "weight_divergence").
    weight_divergence: str = "norm"
    # The AdamW √v̂ gradients and their errors are preconditioned by (``adam_moments.adam_denominator``).
    preconditioner: str = "stored"

    def __post_init__(self) -> None:
        if self.curvature_noise not in CURVATURE_NOISE:
            raise ValueError(f"snip.curvature_noise={self.curvature_noise!r}: choose one of {list(CURVATURE_NOISE)}")
        if self.loss_first_order not in LOSS_FIRST_ORDER:
            raise ValueError(f"snip.loss_first_order={self.loss_first_order!r}: choose one of {list(LOSS_FIRST_ORDER)}")
        if self.weight_divergence not in WEIGHT_DIVERGENCE:
            raise ValueError(f"snip.weight_divergence={self.weight_divergence!r}: choose one of {list(WEIGHT_DIVERGENCE)}")
        if self.preconditioner not in PRECONDITIONERS:
            raise ValueError(f"snip.preconditioner={self.preconditioner!r}: choose one of {list(PRECONDITIONERS)}")


class StatsCollector:
    """Runs the three passes on a ``ProbeHost``'s model (``snip/host.py``) and returns a ``snapshot`` dict.

    Works on one pipeline stage's linears (all of them when pp == 1). The caller
    reduces snapshots over TP/DP (``snip.gather.reduce_snapshot``) before the
    metrics. Gradients produced here are discarded; model precisions are restored.

    Memory: pass 1 keeps every linear's G (T, N) of each probe micro-batch for pass 2's
    differences - about one micro-batch's worth of layer outputs per probe micro-batch; pass 3
    keeps one forward graph of ``propagation_sequences`` sequences.
    """

    def __init__(self, probe_cfg: ProbeConfig) -> None:
        self.cfg = probe_cfg

    # --- probes installed on PrecisionLinear.probe -------------------------------------
    @contextlib.contextmanager
    def _probes(self, linears: list[PrecisionLinear], mode: str, records: dict[str, _Record],
                gen: torch.Generator | None = None) -> Iterator[None]:
        """Route every linear's GEMM through a BF16 probe: mode "record" keeps X, Y, G and the
        GEMM's dX, "noise" adds ``records[k].noise`` to Y and keeps G, "inputs" keeps X with its
        autograd graph, "plain" only runs BF16 (and any gradient noise injection the record asks for)."""
        def make(rec: _Record):
            def probe(module: PrecisionLinear, x: torch.Tensor) -> torch.Tensor:
                if mode == "noise" and not x.requires_grad and torch.is_grad_enabled():
                    # Nothing upstream needs a gradient (e.g. a first layer whose weights are
                    # frozen for the noise pass): no graph to cut, so make X a leaf to keep G flowing.
                    x = x.detach().requires_grad_()
                if rec.grad_noise_sigma > 0 and x.requires_grad:
                    eps = torch.randn(x.shape, generator=gen, device=x.device) * rec.grad_noise_sigma
                    rec.grad_noise_sq = (rec.grad_noise_sq or []) + [eps.pow(2).sum()]
                    x.register_hook(lambda g: g + eps.to(g.dtype))
                if mode == "record" and x.requires_grad:
                    # An alias of X whose gradient is this GEMM's dgrad alone (X may feed others).
                    x_own = x.view_as(x)
                    x_own.register_hook(lambda g: setattr(rec, "dx", g.detach() if g.dtype == torch.float32 else None))
                    y = module.local_gemm(x_own, BF16)
                else:
                    y = module.local_gemm(x, BF16)
                if mode == "record":
                    rec.x = x.detach()
                    rec.y = y.detach() if y.dtype == torch.float32 else None
                elif mode == "inputs":
                    rec.x = x  # with its graph: the propagation pass differentiates it
                if rec.noise is not None:
                    y = _add_noise(y, rec)
                if y.requires_grad and mode in ("record", "noise"):
                    y.register_hook(lambda g: setattr(rec, "g", g.detach()))
                return y

            return probe

        for lin in linears:
            lin.probe = make(records[key_of(lin)])
        try:
            yield
        finally:
            for lin in linears:
                lin.probe = None

    # --- the passes ------------------------------------------------------------------------
    def collect(self, host: ProbeHost, probe_batches: list[torch.Tensor], step: int, *,
                noise_passes: bool = True) -> dict[str, Any]:
        """Statistics of ``host.model`` on ``probe_batches`` (each (B, S+1) tokens).

        ``noise_passes=False`` runs only pass 1 (norms and measured errors: all the local-error
        baseline ``min_rel_err`` needs, ~3/5 of the cost on `tiny`); the snapshot then has no curvature or
        propagation and says so in ``"noise_passes"`` (``metrics.snip_costs`` refuses it).
        """
        return self.collect_with_reference(host, probe_batches, step, 0, noise_passes=noise_passes)[0]

    def collect_with_reference(self, host: ProbeHost, probe_batches: list[torch.Tensor], step: int, reuse: int, *,
                               noise_passes: bool = True) -> tuple[dict[str, Any], ReferencePass | None]:
        """``collect``, also keeping what the reference pass computed on the first ``reuse`` probe
        batches (their gradients and losses) for the training step of ``step`` to take
        (``snip.reuse_step``; ``reuse`` = 0: nothing kept, None returned). The snapshot is the same
        either way. Memory: one copy of this rank's gradients while the later passes run (none when
        ``reuse`` covers every probe batch: the reference gradients are then kept as they are)."""
        model, optimizer = host.model, host.optimizer
        linears = list(model.precision_linears())
        keys = [key_of(lin) for lin in linears]
        gen = torch.Generator(device=host.device).manual_seed(self.cfg.seed * 1_000_003 + step)
        n = len(probe_batches)
        if not 0 <= reuse <= n:
            raise ValueError(f"collect_with_reference: reuse={reuse} of {n} probe batches")
        sums: dict[str, dict[str, Any]] = {k: _empty_linear_sums(lin, self.cfg.formats) for k, lin in zip(keys, linears)}
        edw_acc: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
        timings: dict[str, float] = {}
        # Every statistic stays on the device until the reads below (DeviceSums: one transfer each,
        # after pass 1, for the noise scales, and at the end), not one float() per value.
        pending = DeviceSums()
        optimizer.zero_grad(set_to_none=True)

        # Pass 1: reference forward/backward and measured GEMM errors per format.
        t0 = time.perf_counter()
        losses = []
        reference_g: list[dict[str, torch.Tensor]] = []  # per probe batch: each linear's G(0), for pass 2
        # per probe batch: each linear's e_Y per format, kept for error-direction noise (pass 2)
        errors_y: list[dict[str, dict[str, torch.Tensor]]] = []
        keep_ey = noise_passes and self.cfg.curvature_noise == "error"
        q = {"generator": gen, "compiled": self.cfg.compiled_quantizers}
        errors_w = {k: {f: weight_error(lin, f, **q) for f in self.cfg.formats} for k, lin in zip(keys, linears)}
        reference = None
        for b, tokens in enumerate(probe_batches):
            records = {k: _Record() for k in keys}
            with self._probes(linears, "record", records, gen):
                losses.append(host.forward_backward([tokens]))
            if b + 1 == reuse:  # the reference pass of the step's first micro-batches: keep it
                last = b + 1 == n  # no later probe batch accumulates into these gradients
                kept = [(p, p.grad.detach() if last else p.grad.detach().clone())
                        for p in model.parameters() if p.grad is not None]
                reference = ReferencePass(step, reuse, kept, losses[:reuse])
            reference_g.append({k: records[k].g for k in keys})
            errors_y.append({})
            for k, lin in zip(keys, linears):
                e_y = self._measure_errors(lin, records[k], sums[k], edw_acc[k], errors_w[k], gen, pending,
                                           first_batch=b == 0)
                if keep_ey:
                    errors_y[b][k] = e_y
        grads = {id(p): p.grad.detach() / n for p in model.parameters() if p.grad is not None}
        timings["reference_pass_s"] = time.perf_counter() - t0

        # AdamW preconditioning: wgrad update errors and the reference update norm; and the probe
        # gradient's squared norm as the trainer's clip counts it (each TP-replicated tensor once).
        totals = {"total_sq_update": 0.0, "probe_sq_grad": 0.0, "probe_loss_sum": 0}
        denominators: dict[int, torch.Tensor] = {}
        steps = adam_steps(optimizer, [p for p in model.parameters() if id(p) in grads])
        for p in model.parameters():
            if id(p) not in grads:
                continue
            denom = adam_denominator(optimizer, p, grads[id(p)], steps.get(id(p)),
                                     with_grad=self.cfg.preconditioner == "with_probe")
            denominators[id(p)] = denom
            pending.add(totals, "total_sq_update", (grads[id(p)] / denom).pow(2).sum())
            if counted_once(getattr(p, "tensor_parallel", False), host.topo):
                pending.add(totals, "probe_sq_grad", grads[id(p)].pow(2).sum())
        for k, lin in zip(keys, linears):
            denom = denominators[id(lin.weight)]
            s = sums[k]
            pending.set(s, "sq_dw", grads[id(lin.weight)].pow(2).sum(), then=lambda v: v * n * n)
            pending.set(s, "sq_dw_precond", (grads[id(lin.weight)] / denom).pow(2).sum())
            for f, e in edw_acc[k].items():
                pending.set(s["per_format"][f], "sq_edw", e.pow(2).sum())
                pending.set(s["per_format"][f], "sq_edw_precond", (e / n / denom).pow(2).sum())
            add_adam_norms(optimizer, lin.weight, s, pending)
            add_momentum_first_order(optimizer, lin.weight, errors_w[k], s, pending, steps.get(id(lin.weight)))
        for loss in losses:
            pending.add(totals, "probe_loss_sum", loss)
        pending.settle()  # the one read of pass 1: the noise passes scale their noise by these sums
        optimizer.zero_grad(set_to_none=True)

        propagation: dict[str, dict[str, float]] = {}
        if noise_passes:
            propagation = self._noise_passes(host, linears, keys, probe_batches, reference_g, errors_y, denominators,
                                             sums, gen, timings, pending)
            pending.settle()  # the one read of passes 2 and 3
        return {
            "step": step,
            "formats": list(self.cfg.formats),
            "num_probe_batches": n,
            "probe_loss_sum": totals["probe_loss_sum"],
            "total_sq_update": totals["total_sq_update"],
            "probe_sq_grad": totals["probe_sq_grad"],
            "replicas": 1,
            "noise_passes": noise_passes,
            "loss_first_order": self.cfg.loss_first_order,
            "weight_divergence": self.cfg.weight_divergence,
            "linears": sums,
            "propagation": propagation,
            "timings": timings,
        }, reference

    def _noise_passes(self, host: ProbeHost, linears: list[PrecisionLinear], keys: list[str],
                      probe_batches: list[torch.Tensor], reference_g: list[dict[str, torch.Tensor]],
                      errors_y: list[dict[str, dict[str, torch.Tensor]]],
                      denominators: dict[int, torch.Tensor], sums: dict[str, dict[str, Any]],
                      gen: torch.Generator, timings: dict[str, float], pending: DeviceSums) -> dict[str, dict[str, float]]:
        """Passes 2 and 3: curvature sums into ``sums``; returns the propagation gains (both
        complete once ``pending`` is settled)."""
        optimizer = host.optimizer
        # Pass 2: forward noise -> curvature along Y. One noisy pass per draw, differenced against
        # the reference pass's G(0): at the same number of passes this is less noisy than
        # antithetic ±ε pairs, whose only gain (cancelling the zero-mean third-order term) is
        # small next to the cross-layer terms (experiments/exp_curvature_estimator.py).
        t0 = time.perf_counter()
        harshest = harshest_format(self.cfg.formats, sums)
        for k in keys:
            sums[k]["noise_sigma"] = forward_noise_sigma(sums[k], harshest)
        for tokens, g_ref, e_y in zip(probe_batches, reference_g, errors_y):
            for _ in range(self.cfg.noise_draws):
                noise = forward_noise(self.cfg.curvature_noise, keys, g_ref, e_y, harshest, sums, gen)
                g_noisy, realized = self.noisy_output_grads(host, tokens, noise)
                for k in keys:
                    eps = realized[k]
                    pending.add(sums[k], "curv_num", (eps * (g_noisy[k] - _flat(g_ref[k]))).sum())
                    pending.add(sums[k], "curv_den", eps.pow(2).sum())
        timings["forward_noise_pass_s"] = time.perf_counter() - t0

        # Pass 3: exact propagation gain of dgrad errors to earlier parameters.
        t0 = time.perf_counter()
        propagation = self._propagation_pass(host, linears, keys, probe_batches[0], denominators, sums, gen, harshest,
                                             pending)
        optimizer.zero_grad(set_to_none=True)
        timings["backward_noise_pass_s"] = time.perf_counter() - t0
        return propagation

    def _measure_errors(self, lin: PrecisionLinear, rec: _Record, s: dict[str, Any], edw_acc: dict[str, torch.Tensor],
                        errors_w: dict[str, torch.Tensor], gen: torch.Generator, pending: DeviceSums, *,
                        first_batch: bool) -> dict[str, torch.Tensor]:
        """Adds one probe batch's norms and measured errors to ``s`` (through ``pending``: in ``s``
        once it is settled); returns e_Y per format, (T, N) fp32."""
        assert rec.x is not None and rec.g is not None, f"linear {key_of(lin)} saw no forward/backward"
        x, g, w = _flat(rec.x), _flat(rec.g), lin.weight.detach().float()
        # Y and dX from the pass itself when it ran in fp32 (under bf16 autocast they carry bf16
        # rounding, which would bias the measured errors: recompute in fp32 then).
        y_ref = _flat(rec.y) if rec.y is not None else x @ w.t()
        dx_ref = _flat(rec.dx) if rec.dx is not None else g @ w
        dw_ref = g.t() @ x
        s["tokens"] += x.shape[0]
        pending.add(s, "sq_x", x.pow(2).sum())
        pending.add(s, "sq_y", y_ref.pow(2).sum())
        pending.add(s, "sq_g", g.pow(2).sum())
        pending.add(s, "sq_dx", dx_ref.pow(2).sum())
        pending.set(s, "sq_w", w.pow(2).sum())
        s["numel_y"] += y_ref.numel()
        # Stochastic rounding here draws from ``gen``: it must not consume the training stream.
        q = {"generator": gen, "compiled": self.cfg.compiled_quantizers}
        errors_y = {}
        for f in self.cfg.formats:
            y_q, dx_q, dw_q = quantized_gemms(lin, x, g, GemmPrecision.uniform(f), **q)
            e_y, e_dx, e_dw = y_q - y_ref, dx_q - dx_ref, dw_q - dw_ref
            pf = s["per_format"][f]
            dot = (g * e_y).sum()
            pending.add(pf, "grad_dot_ey", dot)
            pending.add(pf, "grad_dot_ew", (dw_ref * errors_w[f]).sum())
            pending.add_abs(pf, "abs_grad_dot_ey", dot)
            pending.add(pf, "sq_ey", e_y.pow(2).sum())
            pending.add(pf, "sq_edx", e_dx.pow(2).sum())
            edw_acc[f] = edw_acc[f] + e_dw if f in edw_acc else e_dw
            if f != "bf16":  # BF16 operands are exact: ‖Q(a) - a‖² stays 0
                pending.add(pf, "sq_qerr_x", operand_error_t(lin, x, w, f, "x", **q))
                pending.add(pf, "sq_qerr_g", operand_error_t(lin, g, w, f, "g", **q))
                if first_batch:  # W is the same for every probe batch
                    pending.set(pf, "sq_qerr_w", operand_error_t(lin, x, w, f, "w", **q))
            errors_y[f] = e_y
        return errors_y

    def noisy_output_grads(self, host: ProbeHost, tokens: torch.Tensor, noise: Mapping[str, torch.Tensor] | None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One forward-noise pass (pass 2) on a (B, S+1) micro-batch: ``noise[k]`` (fp32, shaped like
        linear ``k``'s output Y, B x S x N on this TP rank) is added to every linear's Y at once.

        Returns (G, δ), each {key: (T, N) fp32}: every linear's G = dL/dY, and the perturbation δ
        the noise actually made to its Y (``_add_noise``: ε rounded with Y into the pass's
        activation dtype, bf16 under autocast; ≈ ε in fp32). The curvature sums must use δ, not
        ε: that is the direction whose gradient change G measures, on every device and dtype.
        ``noise=None``: the noise-free pass (δ empty). Only G is needed: linear weights are frozen
        (their wgrad GEMMs skipped) and the gradients are discarded."""
        linears = list(host.model.precision_linears())
        keys = [key_of(lin) for lin in linears]
        records = {k: _Record(noise=None if noise is None else noise[k]) for k in keys}
        with self._probes(linears, "noise", records), _frozen_weights(linears):
            host.forward_backward([tokens])
        host.optimizer.zero_grad(set_to_none=True)
        realized = {k: _flat(records[k].noise_realized) for k in keys if records[k].noise_realized is not None}
        return {k: _flat(records[k].g) for k in keys}, realized

    def _propagation_pass(self, host: ProbeHost, linears: list[PrecisionLinear], keys: list[str], tokens: torch.Tensor,
                          denominators: dict[int, torch.Tensor], sums: dict[str, dict[str, Any]],
                          gen: torch.Generator, harshest: str, pending: DeviceSums) -> dict[str, dict[str, float]]:
        """Gain of an error in each linear's input gradient on the AdamW-preconditioned gradients
        of everything before it: {"<layer>.<linear>": {"num": Σ‖J·ε ⊘ (√v̂+eps)‖², "den": ‖ε‖²}}.

        For each linear of the *whole model*, Gaussian noise ε (at the scale of the harshest
        format's dgrad error) is added to the gradient of that linear's GEMM input X, on the
        first ``propagation_sequences`` sequences of ``tokens``. Backprop is linear in the
        upstream gradient, so each earlier parameter's gradient changes by exactly J·ε, where
        J = ∂X/∂θ. Every rank walks the same global list of linears (so collectives match);
        only the owner injects - for a column-parallel linear, whose X is replicated over TP,
        only TP rank 0. Each rank reports its own parameters' share of "num" and its injected
        "den"; the controller sums both over TP and PP ranks.

        With one pipeline stage J·ε is a vector-Jacobian product on one retained forward graph
        (``_propagation_by_vjp``); across stages, or with a backend that allows one backward per
        graph (Transformer Engine), it is the difference of whole backward passes
        (``_propagation_by_reruns``). Both draw the same ε from ``gen``.
        """
        tokens = tokens[: self.cfg.propagation_sequences]
        params = [p for p in host.model.parameters() if id(p) in denominators]
        tp_rank = host.topo.tp_rank
        by_key = dict(zip(keys, linears))
        injections: dict[str, float] = {}  # key -> σ of the noise this rank injects at that linear's input
        for key in (f"{layer}.{lin}" for layer in range(host.num_layers) for lin in LINEARS):
            owner = by_key.get(key)
            if owner is not None and (tp_rank == 0 or not _input_replicated_over_tp(owner)):
                s = sums[key]
                numel_x = max(1, s["tokens"] * s["shape"][1])
                injections[key] = math.sqrt(s["per_format"][harshest]["sq_edx"] / numel_x) or 1e-12
            else:
                injections[key] = 0.0
        one_stage = host.topo.pp == 1
        if one_stage and all(lin.backend.repeatable_backward for lin in linears):
            return self._propagation_by_vjp(host, linears, keys, tokens, params, denominators, injections, gen, pending)
        return self._propagation_by_reruns(host, linears, keys, tokens, params, denominators, injections, gen, pending)

    def _propagation_by_vjp(self, host: ProbeHost, linears: list[PrecisionLinear], keys: list[str],
                            tokens: torch.Tensor, params: list[torch.Tensor], denominators: dict[int, torch.Tensor],
                            injections: dict[str, float], gen: torch.Generator,
                            pending: DeviceSums) -> dict[str, dict[str, float]]:
        """pp == 1: one forward keeping each GEMM input X with its graph, then per linear
        ``autograd.grad(X, θ, ε)`` = J·ε exactly. J does not depend on anything after X, so
        neither the loss's backward nor a reference pass is needed (17 -> 1 forward on tiny)."""
        records = {k: _Record() for k in keys}
        # One graph, one backward per linear: recompute would re-run its regions' forward each time.
        with self._probes(linears, "inputs", records, gen), keep_intermediates():
            host.forward_loss(tokens)
        out: dict[str, dict[str, float]] = {}
        for key, sigma in injections.items():
            x = records[key].x if key in records else None
            if x is None or not x.requires_grad:  # not in this model, or nothing upstream (e.g. a data input)
                out[key] = {"num": 0.0, "den": 0.0}
                continue
            # A TP rank that does not inject still runs the product (with zeros): its collectives must match.
            eps = torch.randn(x.shape, generator=gen, device=x.device) * sigma if sigma > 0 else torch.zeros_like(x)
            deltas = torch.autograd.grad(x, params, grad_outputs=eps.to(x.dtype), retain_graph=True,
                                         allow_unused=True)
            # As the host sum over the parameters did: 0 + the first + ... in order (``sum``'s start).
            out[key] = {"num": 0, "den": 0.0}
            for p, d in zip(params, deltas):
                if d is not None:
                    pending.add(out[key], "num", (d.float() / denominators[id(p)]).pow(2).sum())
            if sigma > 0:
                pending.set(out[key], "den", eps.pow(2).sum())
        return out

    def _propagation_by_reruns(self, host: ProbeHost, linears: list[PrecisionLinear], keys: list[str],
                               tokens: torch.Tensor, params: list[torch.Tensor],
                               denominators: dict[int, torch.Tensor], injections: dict[str, float],
                               gen: torch.Generator, pending: DeviceSums) -> dict[str, dict[str, float]]:
        """Any pipeline layout: one reference forward/backward (``host.forward_backward``,
        pipelined when pp > 1), then one per linear with ε added to the gradient of its X by a
        hook; J·ε is the difference of the parameter gradients."""
        optimizer = host.optimizer

        def gradients(inject: str | None) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
            optimizer.zero_grad(set_to_none=True)
            records = {k: _Record() for k in keys}
            if inject is not None:
                records[inject].grad_noise_sigma = injections[inject]
            with self._probes(linears, "plain", records, gen):
                host.forward_backward([tokens])
            grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
            return grads, ((records[inject].grad_noise_sq or []) if inject is not None else [])

        reference, _ = gradients(None)
        out: dict[str, dict[str, float]] = {}
        for key, sigma in injections.items():
            grads, den = gradients(key if sigma > 0 else None)
            out[key] = {"num": 0, "den": 0.0}  # the host sums' starts, as before: num from sum(), den from 0.0
            for p, g, g0 in zip(params, grads, reference):
                if g is not None and g0 is not None:
                    pending.add(out[key], "num", ((g - g0).float() / denominators[id(p)]).pow(2).sum())
            for part in den:
                pending.add(out[key], "den", part)
        return out


def forward_noise(kind: str, keys: list[str], g_ref: Mapping[str, torch.Tensor],
                  e_y: Mapping[str, Mapping[str, torch.Tensor]], harshest: str, sums: Mapping[str, Mapping[str, Any]],
                  gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One draw of pass 2's noise, {key: (T, N) fp32} in every linear's Y at once.

    "gaussian": ε ~ N(0, σ²I), σ = ``forward_noise_sigma``; κ is then the mean curvature of the
    loss along Y (a trace). "error": ε = s·e_Y(harshest) of this probe batch, with a random sign
    s = ±1 per linear: κ = e_Yᵀ H e_Y / ‖e_Y‖², the curvature along the error the metric prices
    (quantization errors are not isotropic: they follow the blocks' large elements), and the
    cross-layer terms s_ℓ·s_m·e_ℓᵀ H e_m still have zero mean. Either way the draws come from
    ``gen`` in key order, the same on every TP rank of a linear."""
    if kind == "gaussian":
        return {k: torch.randn(g_ref[k].shape, generator=gen, device=g_ref[k].device) * sums[k]["noise_sigma"]
                for k in keys}
    signs = (torch.randint(0, 2, (len(keys),), generator=gen, device=gen.device) * 2.0 - 1.0).tolist()  # one read
    return {k: s * e_y[k][harshest] for k, s in zip(keys, signs)}


def _add_noise(y: torch.Tensor, rec: _Record) -> torch.Tensor:
    """Y + ε in Y's dtype (the pass's activation dtype: the graph after Y runs as in training), and
    in ``rec.noise_realized`` the perturbation that made, δ = (Y + ε) - Y in fp32. Under bf16 the sum
    rounds: δ differs from ε by up to half an ulp of Y per element (all of ε where |ε| is below it),
    so summing ⟨ε, ΔG⟩/‖ε‖² would price a perturbation that never happened. The difference is
    taken in fp64, where it is exact for bf16 and fp32 operands, then stored in fp32."""
    assert rec.noise is not None
    y_noisy = y + rec.noise.view_as(y).to(y.dtype)
    rec.noise_realized = (y_noisy.detach().double() - y.detach().double()).float()
    return y_noisy


def forward_noise_sigma(s: dict[str, Any], harshest: str) -> float:
    """σ of pass 2's noise on one linear's Y: the scale of the error being priced,
    ‖e_Y(harshest)‖ / sqrt(T·N) per element (``s``: that linear's pass-1 sums)."""
    return math.sqrt(s["per_format"][harshest]["sq_ey"] / max(1.0, s["numel_y"]))


def _empty_linear_sums(lin: PrecisionLinear, formats: tuple[str, ...]) -> dict[str, Any]:
    return {
        "layer": lin.layer, "linear": lin.linear, "shape": [lin.out_features, lin.in_features],
        "tokens": 0, "numel_y": 0, "sq_x": 0.0, "sq_w": 0.0, "sq_y": 0.0, "sq_g": 0.0, "sq_dx": 0.0,
        "sq_dw": 0.0, "sq_dw_precond": 0.0, "sq_m": 0.0, "sq_v": 0.0,
        "curv_num": 0.0, "curv_den": 0.0, "noise_sigma": 0.0,
        "per_format": {f: {k: 0.0 for k in PER_FORMAT_KEYS} for f in formats},
    }


def harshest_format(formats: tuple[str, ...], sums: Mapping[str, Mapping[str, Any]]) -> str:
    """The candidate format with the largest total forward error over ``sums`` (pass 1's per-linear
    sums): it sets the metrics' normalization and the noise passes' scale."""
    return max(formats, key=lambda f: sum(s["per_format"][f]["sq_ey"] for s in sums.values()))


@contextlib.contextmanager
def _frozen_weights(linears: list[PrecisionLinear]) -> Iterator[None]:
    """Linear weights with requires_grad off (autograd then skips their wgrad GEMMs), restored after."""
    flags = [lin.weight.requires_grad for lin in linears]
    for lin in linears:
        lin.weight.requires_grad_(False)
    try:
        yield
    finally:
        for lin, flag in zip(linears, flags):
            lin.weight.requires_grad_(flag)


def _input_replicated_over_tp(lin: PrecisionLinear) -> bool:
    """Column-parallel linears see the whole (replicated or all-gathered) input on every TP rank."""
    return isinstance(lin, ColumnParallelLinear) and lin.tp.size > 1


def key_of(lin: PrecisionLinear) -> str:
    return f"{lin.layer}.{lin.linear}"


