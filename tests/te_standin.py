"""A CPU stand-in for the parts of ``transformer_engine`` the te backend touches.

``FakeTE`` provides ``pytorch.Linear`` (a bias-free linear reading ``self.weight`` at every
forward, as te.Linear does), ``pytorch.autocast(enabled, recipe, ...)`` and ``common.recipe``'s
recipe classes, and records what the backend did (modules built with their arguments, recipes
built, each forward's recipe and ``is_first_microbatch``).

Numerics: what TE computes for a ``te.Linear`` built with ``parallel_mode=None`` (no TE
communication, no amax reduction: ``Linear._customize_quantizers_*`` set an amax group only for
TE's own column/row modes under sequence parallelism): each of X, W and dY quantized with its
*local* amax in the active recipe's format - modelled with the reference quantizers
(``quant_linear`` without reducers). TE's kernels match the reference closely but not bit for
bit, so this checks our plumbing (which tensors reach TE, with which flags), not TE.

TE's weight cache is modelled as a contract check: ``is_first_microbatch=True`` keeps the
weight's (format, version); ``False`` raises unless the kept one is still the weight's current
version in the same format - the kept FP8 copy TE would reuse would be stale otherwise.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from megatron_snip.precision.gemm import quant_linear
from megatron_snip.precision.plan import GemmPrecision

RECIPE_FORMATS = {"Float8CurrentScaling": "fp8", "Float8BlockScaling": "fp8_block", "MXFP8BlockScaling": "mxfp8",
                  "NVFP4BlockScaling": "nvfp4"}


class FakeTE:
    """Stand-in ``transformer_engine`` modules (``sys_modules``) that record calls."""

    def __init__(self) -> None:
        self.modules_built: list[torch.nn.Module] = []
        self.module_kwargs: list[dict] = []
        self.recipes_built: list[object] = []
        self.forward_recipes: list[object] = []
        self.first_microbatch_flags: list[bool | None] = []
        self._active: list[object] = []
        fake = self

        class Linear(torch.nn.Module):
            def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kw):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype,
                                                             device=device))
                self._kept: tuple[str, int] | None = None  # (format, weight version) of the kept quantized weight
                fake.modules_built.append(self)
                fake.module_kwargs.append(kw)

            def forward(self, inp, is_first_microbatch=None):
                recipe = fake._active[-1] if fake._active else None
                fake.forward_recipes.append(recipe)
                fake.first_microbatch_flags.append(is_first_microbatch)
                if recipe is None:
                    return F.linear(inp, self.weight.to(inp.dtype))  # TE computes in the input (or autocast) dtype
                fmt = RECIPE_FORMATS[type(recipe).__name__]
                if is_first_microbatch is False and self._kept != (fmt, self.weight._version):
                    raise RuntimeError(f"is_first_microbatch=False would reuse a kept weight {self._kept} that is not "
                                       f"this weight's ({fmt}, version {self.weight._version})")
                if is_first_microbatch:
                    self._kept = (fmt, self.weight._version)
                return quant_linear(inp, self.weight, GemmPrecision.uniform(fmt))  # local amaxes

        @contextlib.contextmanager
        def autocast(enabled=True, recipe=None, amax_reduction_group=None):
            fake._active.append(recipe)
            try:
                yield
            finally:
                fake._active.pop()

        def recipe_class(name):
            def init(self, **kw):
                self.kw = kw
                fake.recipes_built.append(self)
            return type(name, (), {"__init__": init})

        recipe = types.ModuleType("transformer_engine.common.recipe")
        for name in RECIPE_FORMATS:
            setattr(recipe, name, recipe_class(name))
        recipe.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
        pt = types.ModuleType("transformer_engine.pytorch")
        pt.Linear, pt.autocast = Linear, autocast
        common = types.ModuleType("transformer_engine.common")
        common.recipe = recipe
        root = types.ModuleType("transformer_engine")
        root.pytorch, root.common = pt, common
        self.sys_modules = {"transformer_engine": root, "transformer_engine.pytorch": pt,
                            "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}

    def install(self, setitem) -> FakeTE:
        """Put the stand-in into ``sys.modules`` through ``setitem(sys.modules, name, module)``
        (pytest's ``monkeypatch.setitem``, or ``operator.setitem`` in a spawned worker)."""
        import sys

        for name, mod in self.sys_modules.items():
            setitem(sys.modules, name, mod)
        return self
