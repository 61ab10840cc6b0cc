"""The Transformer Engine backend: TE's ``Linear`` under a per-format recipe.

Transformer Engine is imported lazily, inside functions only: it is an optional
GPU dependency (``pip install .[gpu]``) and this module must import on CPU.

What it does and does not do:
  * One recipe per linear: TE applies a recipe to all three GEMMs of a module,
    so a ``GemmPrecision`` must name the same format for fprop, dgrad and
    wgrad (mixed per-GEMM precisions need ``precision.backend="emulated"``).
  * Recipes: fp8 -> Float8CurrentScaling(HYBRID: E4M3 fwd, E5M2 bwd),
    fp8_block -> Float8BlockScaling(E4M3; 1x128 / 128x128 blocks, pow2 scales),
    mxfp8 -> MXFP8BlockScaling(E4M3), nvfp4 -> NVFP4BlockScaling() (defaults:
    2-D weight blocks, SR on gradients, RHT on the wgrad operands); bf16 runs
    the module with quantization disabled; mxfp4 has no TE recipe.
  * The caller's weight Parameter is installed in a private ``te.Linear``
    (TE reads ``self.weight`` by name at every forward), so gradients land on
    the caller's Parameter as with ``quant_linear``.
  * TP amax reduction in TE takes a process group, not a callable: build
    ``TEBackend(amax_group=tp_group)``.
  * Stochastic rounding uses TE's own CUDA RNG; ``generator`` is not used.
  * TE's numerics follow its kernels (e.g. its NVFP4 scale arithmetic), so they
    match the emulated reference closely but not bit for bit.
This module has not been run on a GPU in this repository yet (see tests/gpu/).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from megatron_snip.precision.backends import Backend
from megatron_snip.precision.plan import GemmPrecision


def make_recipe(fmt: str) -> Any:
    """The TE recipe object for ``fmt`` (None for bf16); ValueError for mxfp4 (no TE recipe)."""
    if fmt == "bf16":
        return None
    if fmt not in ("fp8", "fp8_block", "mxfp8", "nvfp4"):
        raise ValueError(f"format {fmt!r} has no Transformer Engine recipe; set precision.backend=\"emulated\"")
    from transformer_engine.common import recipe as te_recipe

    if fmt == "fp8":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    if fmt == "fp8_block":
        return te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    if fmt == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    return te_recipe.NVFP4BlockScaling()  # nvfp4


def _autocast(recipe: Any, group: Any) -> AbstractContextManager:
    """TE's quantization context: ``te.autocast`` (TE >= 2.8) or the older ``te.fp8_autocast``."""
    if recipe is None:
        return nullcontext()
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


def uniform_format(precision: GemmPrecision) -> str:
    """The single format of ``precision``; ValueError if its GEMMs differ (TE runs one recipe per module)."""
    fmts = {precision.fprop, precision.dgrad, precision.wgrad}
    if len(fmts) != 1:
        raise ValueError(
            f"the te backend runs one recipe per linear, but {precision} mixes formats; "
            'use precision.backend="emulated" for per-GEMM precisions (or a layer-granular plan)'
        )
    return fmts.pop()


class TEBackend(Backend):
    """Runs linears through ``transformer_engine.pytorch.Linear`` (CUDA only).

    Args:
        amax_group: process group over which TE reduces tensor amaxes (the TP
            group under tensor parallelism), or None.
    """

    name = "te"
    # te.Linear frees its saved tensors in backward (NVIDIA/TransformerEngine#990): one backward per graph.
    repeatable_backward = False

    def __init__(self, amax_group: Any = None) -> None:
        self.amax_group = amax_group
        # weight Parameter -> the te.Linear that runs it (dies with the Parameter)
        self._modules: weakref.WeakKeyDictionary[torch.Tensor, Any] = weakref.WeakKeyDictionary()

    def _module_for(self, weight: torch.Tensor) -> Any:
        module = self._modules.get(weight)
        if module is None:
            import transformer_engine.pytorch as te

            out_features, in_features = weight.shape
            module = te.Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device=weight.device)
            module.weight = weight  # TE fetches getattr(self, "weight") each forward
            self._modules[weight] = module
        return module

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        precision: GemmPrecision,
        *,
        amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        fmt = uniform_format(precision)
        ok, reason = self.supports(fmt, x.device)
        if not ok:
            raise ValueError(f"te backend cannot run {fmt}: {reason}. Fix: set precision.backend=\"emulated\"")
        if amax_reduce is not None and self.amax_group is None:
            raise ValueError(
                "te backend reduces amaxes over a process group, not a callable: "
                "build TEBackend(amax_group=tp_group) instead of passing amax_reduce"
            )
        if not isinstance(weight, torch.nn.Parameter):
            raise TypeError("te backend needs the weight as an nn.Parameter (it is installed in a te.Linear)")
        module = self._module_for(weight)
        with _autocast(make_recipe(fmt), self.amax_group):
            return module(x)
