"""The Transformer Engine backend: TE's ``Linear`` under a per-format recipe.

Transformer Engine is imported lazily, inside functions only: it is an optional
GPU dependency (``pip install .[gpu]``) and this module must import on CPU.

What it does and does not do:
  * One recipe per linear: TE applies a recipe to all three GEMMs of a module,
    so a ``GemmPrecision`` must name the same format for fprop, dgrad and
    wgrad. ``check_run`` refuses, at start-up, an initial plan that mixes them
    and SNIP re-planning per GEMM (``snip.granularity="gemm"``); per-GEMM
    precisions need ``precision.backend="torch"`` or ``"emulated"``.
  * Recipes: fp8 -> Float8CurrentScaling(HYBRID: E4M3 fwd, E5M2 bwd),
    fp8_block -> Float8BlockScaling(E4M3; 1x128 / 128x128 blocks, pow2 scales),
    mxfp8 -> MXFP8BlockScaling(E4M3), nvfp4 -> NVFP4BlockScaling() (defaults:
    2-D weight blocks, SR on gradients, RHT on the wgrad operands); bf16 runs
    the module with quantization disabled; mxfp4 has no TE recipe. Each recipe
    is built once per backend, and each (format, device) capability checked once.
  * Tensor parallelism - our comm around a private ``te.Linear`` per shard. Each TP shard runs
    its own ``te.Linear`` with ``parallel_mode=None`` (TE communicates nothing and reduces no
    amax), fed by ``ColumnParallelLinear``/``RowParallelLinear`` with parallel/comm.py's
    collectives around it. Every tensor TE quantizes is then the tensor the emulated reference
    quantizes with ``precision.tp_amax="shard"``, scaled by its local amax: a column-parallel X
    and a row-parallel dY are replicated (our SP gathers them in the activation dtype first), so
    their local amax is the whole tensor's; weight shards, a column-parallel dY and a row-parallel
    X scale by their own. That is also what TE's own ``parallel_mode``/``tp_group``/
    ``sequence_parallel`` would compute: it reduces amaxes over ``tp_group`` only for the input
    of a column-parallel and the output gradient of a row-parallel module under sequence
    parallelism, which it gathers in FP8 - the gathered tensor's amax, the one ours uses (TE's
    ``Linear._customize_quantizers_float8_current_scaling`` / ``_nvfp4``); so the tensor scales
    agree, and only TE's kernels make it differ from the reference. We keep our comm
    because (1) it is the one place that calls torch.distributed, in the order every rank must
    follow, with the SP shard saving/prefetch (parallel/sequence_shard.py) and SNIP's probes
    (which read X and dY at the layer) built on it; (2) TE's parallel modules would replace our
    layer classes and own the weights (their allocation, init and sharding metadata), whereas a
    per-shard module only borrows our Parameter and switches recipes when a re-plan changes the
    linear's format. What it costs: no FP8 all-gather under SP (the gather moves bf16, 2 bytes
    per element instead of 1), no TE userbuffer comm-GEMM overlap, and TE keeps the gathered
    column-parallel input for backward (sizing/ counts it). Formats with a tensor scale (fp8,
    nvfp4) under ``parallel.tp`` > 1 therefore need ``precision.tp_amax="shard"``
    (``check_run``); block-scaled formats need no cross-shard amax. The amax groups TE's
    autocast takes (``amax_reduction_group``, formerly ``fp8_group``) reach delayed scaling only,
    which no recipe here uses.
  * Weights quantized once per step: ``linear`` passes ``is_first_microbatch``
    (``WeightCopy.first_microbatch``: True at a step's first forward of a weight, False at the
    step's later micro-batches, None outside a training step), so TE quantizes the weight at the
    first micro-batch, keeps it and reuses it for the others. One module per weight and
    quantized format: TE resets a kept weight when a usage is missing, not when the recipe
    changes (``get_weight_workspace``), so a re-plan that moves a linear to another quantized
    format replaces its module (dropping the kept weight); bf16 runs in a module of its own,
    which keeps none.
  * NVFP4: TE applies its wgrad RHT to bf16 inputs only, so nvfp4 needs bf16
    activations (bf16 autocast, ``training.dtype``); fp32 is refused.
  * The caller's weight Parameter is installed in a private ``te.Linear``
    (TE reads ``self.weight`` by name at every forward), so gradients land on
    the caller's Parameter as with ``quant_linear``.
  * Stochastic rounding uses TE's own CUDA RNG; ``generator`` is not used.
  * TE's numerics follow its kernels (e.g. its NVFP4 scale arithmetic), so they
    match the emulated reference closely but not bit for bit.
Our wrapper logic is tested on CPU against a stand-in with ``te.Linear``'s interface and
TE's per-shard scaling (tests/te_standin.py; tests/unit/test_te_backend_wrapper.py, and at
TP=2 tests/distributed/test_tp_scaling.py); TE itself has not run in this repository
(tests/gpu/ needs CUDA and transformer_engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from megatron_snip.precision.backends.base import Backend
from megatron_snip.precision.backends.support import check
from megatron_snip.precision.formats import get_format
from megatron_snip.precision.gemm import AmaxReducers
from megatron_snip.precision.plan import GemmPrecision, PrecisionPlan

__all__ = ["TEBackend", "input_dtype_error", "make_recipe", "setting_problems", "uniform_format"]


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


def _autocast(recipe: Any) -> AbstractContextManager:
    """TE's quantization context: ``te.autocast`` (TE >= 2.8) or the older ``te.fp8_autocast``.

    No amax group: it would only reach delayed scaling, which no recipe here uses (see the
    module docstring on tensor parallelism)."""
    if recipe is None:
        return nullcontext()
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def uniform_format(precision: GemmPrecision) -> str:
    """The single format of ``precision``; ValueError if its GEMMs differ (TE runs one recipe per module)."""
    fmts = {precision.fprop, precision.dgrad, precision.wgrad}
    if len(fmts) != 1:
        raise ValueError(
            f"the te backend runs one recipe per linear, but {precision} mixes formats; "
            'use precision.backend="torch" or "emulated" for per-GEMM precisions (or snip.granularity="layer")'
        )
    return fmts.pop()


def _input_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype TE computes x in: the autocast dtype when autocast is on for x's device (TE casts)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def input_dtype_error(fmt: str, dtype: torch.dtype) -> str | None:
    """Why TE cannot run ``fmt`` on linears computing in ``dtype`` (None: it can).

    NVFP4: TE applies its wgrad random Hadamard transform to bf16 inputs only, so an fp32
    input is refused. The one home of the rule: ``setting_problems`` (start-up), ``linear``
    (each call) and tests/unit/test_gpu_shapes.py (every tests/gpu case) ask it.
    """
    if fmt == "nvfp4" and dtype != torch.bfloat16:
        return f"nvfp4 in TE applies its Hadamard transform to bf16 inputs only, but the linears run in {dtype}"
    return None


def setting_problems(formats: Iterable[str], *, tp_size: int, tp_amax: str, per_gemm_replans: bool,
                     activation_dtype: torch.dtype) -> list[str]:
    """What in a run's settings TE cannot do (empty: nothing); shared by ``check_run`` and the dry run.

    Args:
        formats: every format the run may use (the plan's and SNIP's candidates).
        tp_size, tp_amax: ``parallel.tp`` and ``precision.tp_amax``.
        per_gemm_replans: whether re-plans may give the GEMMs of one linear different formats.
        activation_dtype: the dtype the linears see (the autocast dtype, else fp32).
    """
    problems = []
    if per_gemm_replans:
        problems.append('snip.granularity="gemm" re-plans each GEMM separately (TE runs one recipe per '
                        'linear); set snip.granularity="layer"')
    formats = set(formats)
    tensor_scaled = sorted(f for f in formats if get_format(f).uses_tensor_amax)
    if tp_size > 1 and tp_amax != "shard" and tensor_scaled:
        problems.append(f"format(s) {tensor_scaled} have a tensor scale, which TE computes per parallel.tp="
                        f"{tp_size} shard from its local amax (module docstring), while precision.tp_amax="
                        f"{tp_amax!r} asks for the whole tensor's; set precision.tp_amax=\"shard\"")
    dtype_errors = [e for e in (input_dtype_error(f, activation_dtype) for f in sorted(formats)) if e]
    problems += [f"{e}; set training.dtype=\"bfloat16\"" for e in dtype_errors]
    return problems


def refusal(problems: list[str]) -> ValueError:
    """The start-up error for ``problems`` (as ``check_run`` and the dry run raise it)."""
    return ValueError("precision.backend=\"te\" cannot run this configuration: " + "; ".join(problems)
                      + '. Fix as said, or set precision.backend="torch" (per-GEMM FP8 through PyTorch) or "emulated".')


class TEBackend(Backend):
    """Runs linears through ``transformer_engine.pytorch.Linear`` (CUDA only), one per TP shard.

    Args:
        tp_size: tensor-parallel size of the run.
        tp_amax: ``precision.tp_amax``; formats with a tensor scale (fp8, nvfp4) need "shard"
            when ``tp_size`` > 1 (see the module docstring).
    """

    name = "te"
    # te.Linear frees its saved tensors in backward (NVIDIA/TransformerEngine#990): one backward per graph.
    repeatable_backward = False

    def __init__(self, tp_size: int = 1, tp_amax: str = "tensor") -> None:
        self.tp_size, self.tp_amax = tp_size, tp_amax
        # (id(weight Parameter), quantized?) -> (that Parameter, its format, the te.Linear running
        # it). Keyed by id, with the identity checked on lookup: a WeakKeyDictionary compares tensor
        # keys with ``==`` (elementwise) on the second lookup and raises. The te.Linear holds the
        # Parameter anyway, so a strong reference costs nothing the backend did not already keep alive.
        self._modules: dict[tuple[int, bool], tuple[torch.nn.Parameter, str, Any]] = {}
        self._recipes: dict[str, Any] = {}
        self._capable: dict[tuple[str, str], tuple[bool, str]] = {}

    def check_run(self, plan: PrecisionPlan, formats: Iterable[str], *, per_gemm_replans: bool,
                  activation_dtype: torch.dtype) -> None:
        """Refuse at start-up what would otherwise fail mid-run: ValueError naming the setting and the fix.

        Args:
            plan: the initial plan (every linear must use one format for its three GEMMs).
            formats, per_gemm_replans, activation_dtype: as in ``setting_problems``.
        """
        problems = []
        fmts_by_linear: dict[tuple[int, str], set[str]] = {}
        for g, f in plan.entries:
            fmts_by_linear.setdefault((g.layer, g.linear), set()).add(f)
        mixed = sorted(key for key, fs in fmts_by_linear.items() if len(fs) > 1)
        if mixed:
            problems.append(f"precision.initial_plan mixes formats within linear(s) {mixed[:4]}"
                            f"{' ...' if len(mixed) > 4 else ''} (TE runs one recipe per linear)")
        problems += setting_problems(formats, tp_size=self.tp_size, tp_amax=self.tp_amax,
                                     per_gemm_replans=per_gemm_replans, activation_dtype=activation_dtype)
        if problems:
            raise refusal(problems)

    def _recipe(self, fmt: str) -> Any:
        if fmt not in self._recipes:
            self._recipes[fmt] = make_recipe(fmt)
        return self._recipes[fmt]

    def supports(self, fmt: str, device: torch.device | str | None = None) -> tuple[bool, str]:
        """(ok, reason): can TE run GEMMs in ``fmt`` on ``device``? (``support.check``)"""
        cap = check(self.name, fmt, device)
        return cap.ok, cap.reason

    def _supports_once(self, fmt: str, device: torch.device) -> tuple[bool, str]:
        key = (fmt, str(device))
        if key not in self._capable:
            self._capable[key] = self.supports(fmt, device)
        return self._capable[key]

    def _module_for(self, weight: torch.nn.Parameter, fmt: str) -> Any:
        """The te.Linear running ``weight`` in ``fmt``: one for bf16, one for the current quantized format."""
        key = (id(weight), fmt != "bf16")
        entry = self._modules.get(key)
        if entry is not None and entry[0] is weight and entry[1] == fmt:
            return entry[2]
        import transformer_engine.pytorch as te

        out_features, in_features = weight.shape
        # parallel_mode=None (the default): no TE communication, no amax reduction (module docstring).
        module = te.Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device=weight.device)
        module.weight = weight  # TE fetches getattr(self, "weight") each forward
        self._modules[key] = (weight, fmt, module)
        return module

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        precision: GemmPrecision,
        *,
        amax_reduce: AmaxReducers | Callable[[torch.Tensor], torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        fmt = uniform_format(precision)
        ok, reason = self._supports_once(fmt, x.device)
        if not ok:
            raise ValueError(f"te backend cannot run {fmt}: {reason}. Fix: set precision.backend=\"emulated\"")
        if AmaxReducers.of(amax_reduce).reduces and get_format(fmt).uses_tensor_amax:
            raise ValueError(f"te backend cannot run {fmt} with a whole-tensor amax across tensor-parallel shards: TE "
                             'scales each shard by its local amax. Fix: precision.tp_amax="shard", a block-scaled '
                             'format (fp8_block, mxfp8), or precision.backend="torch"/"emulated"')
        dtype_error = input_dtype_error(fmt, _input_dtype(x))
        if dtype_error:
            raise ValueError(f"te backend cannot run this call: {dtype_error}. "
                             'Fix: bf16 autocast (training.dtype="bfloat16") or precision.backend="emulated"')
        if not isinstance(weight, torch.nn.Parameter):
            raise TypeError("te backend needs the weight as an nn.Parameter (it is installed in a te.Linear)")
        module = self._module_for(weight, fmt)
        with _autocast(self._recipe(fmt)):
            return module(x, is_first_microbatch=is_first_microbatch)
