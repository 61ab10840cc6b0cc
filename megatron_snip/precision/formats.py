"""Format specifications: what each precision name means.

A format is data: its element types, block geometry and scaling rule. The
quantize-dequantize math lives in the ``quantize`` package; backends and plans refer to
formats by name (``"bf16"``, ``"fp8"``, ...).

Blocks always run along a GEMM's reduction dimension (see ARCHITECTURE.md,
"Numerics conventions"): an operand is presented to the quantizer as a 2-D
tensor whose *last* dimension is the reduction dimension.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

# Points of the random Hadamard transform a format may apply along the wgrad reduction dim
# (``Format.wgrad_hadamard``; TE's NVFP4 recipe uses 16).
RHT_SIZE = 16


class Operand(str, enum.Enum):
    """Which kind of GEMM operand is being quantized (it picks element type and blocking)."""

    ACTIVATION = "activation"  # X (fprop, wgrad)
    WEIGHT = "weight"  # W (fprop, dgrad)
    GRADIENT = "gradient"  # dY (dgrad, wgrad)


@dataclass(frozen=True)
class Element:
    """A small floating-point element grid (sign + ``mbits`` mantissa bits).

    Attributes:
        name: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"`` (OCP names; ml_dtypes
            ``float8_e4m3fn``, ``float8_e5m2``, ``float4_e2m1fn``).
        mbits: explicit mantissa bits.
        emin: exponent of the smallest normal number (values below it are
            subnormals with the fixed spacing 2**(emin - mbits)).
        max: largest finite magnitude; quantizers saturate to it.
    """

    name: str
    mbits: int
    emin: int
    max: float

    @property
    def emax(self) -> int:
        """Exponent of ``max`` (floor(log2(max))): 8 for E4M3, 15 for E5M2, 2 for E2M1."""
        return int(self.max).bit_length() - 1


E4M3 = Element("e4m3", mbits=3, emin=-6, max=448.0)
E5M2 = Element("e5m2", mbits=2, emin=-14, max=57344.0)
E2M1 = Element("e2m1", mbits=1, emin=0, max=6.0)
ELEMENTS: dict[str, Element] = {e.name: e for e in (E4M3, E5M2, E2M1)}


class Scaling(str, enum.Enum):
    """How a format scales an operand before rounding its elements."""

    NONE = "none"  # bf16: no quantization at all
    TENSOR = "tensor"  # one FP32 scale = element.max / amax(tensor)
    BLOCK_POW2 = "block_pow2"  # per block, 2**floor(log2(element.max / amax(block)))
    BLOCK_E8M0 = "block_e8m0"  # per block, E8M0 power of two (OCP MX), see Format.e8m0_round_up
    BLOCK_E4M3_TENSOR = "block_e4m3_tensor"  # NVFP4: E4M3 block scale x FP32 tensor scale
    BLOCK_FP32 = "block_fp32"  # per block, an FP32 scale amax(block) / element.max (fp4_block)


@dataclass(frozen=True)
class Format:
    """One precision format.

    Attributes:
        name: the name plans and configs use.
        bits: element width in bits (16 for bf16).
        block: 1-D block length along the reduction dim for activations and
            gradients (0 = one scale per tensor, or no scaling for bf16).
        weight_block: (rows, cols) 2-D block for weights, or None when weights
            use the same 1-D blocks as activations.
        is_fp4: counts towards the FP4 FLOP share.
        description: one line for tables and errors.
        element: element grid of activations and weights (None for bf16).
        grad_element: element grid of gradients (None = same as ``element``).
        scaling: the scaling rule (see ``Scaling``).
        e8m0_round_up: BLOCK_E8M0 only. True: the scale exponent is rounded up
            so the block max never saturates (ceil(log2(amax / element.max)),
            as TE's MXFP8). False: the OCP MX v1.0 rule
            floor(log2(amax)) - element.emax, where values up to 2x the element
            max saturate.
        stochastic_gradients: gradients are rounded stochastically (NVFP4, fp4_block).
        wgrad_hadamard: both wgrad operands get the 16-point random Hadamard
            transform (NVFP4).

    An FP4 format's recipe switches (``stochastic_gradients``, ``wgrad_hadamard``) can be
    flipped by name: ``get_format("mxfp4+sr+rht")`` (see ``recipe_variant``).
    """

    name: str
    bits: int
    block: int
    weight_block: tuple[int, int] | None
    is_fp4: bool
    description: str
    element: Element | None = None
    grad_element: Element | None = None
    scaling: Scaling = Scaling.NONE
    e8m0_round_up: bool = False
    stochastic_gradients: bool = False
    wgrad_hadamard: bool = False

    def block_for(self, operand: Operand) -> tuple[int, int]:
        """(rows, cols) block of ``operand`` viewed with the reduction dim last; (1, 0) = no blocking."""
        if operand is Operand.WEIGHT and self.weight_block is not None:
            return self.weight_block
        return (1, self.block)

    def element_for(self, operand: Operand) -> Element | None:
        """The element grid ``operand`` is rounded to (None for bf16)."""
        if operand is Operand.GRADIENT and self.grad_element is not None:
            return self.grad_element
        return self.element

    def stochastic_for(self, operand: Operand) -> bool:
        """Whether ``operand`` is rounded stochastically in this format."""
        return self.stochastic_gradients and operand is Operand.GRADIENT

    @property
    def uses_tensor_amax(self) -> bool:
        """True when a whole-tensor amax enters the scales (it must be reduced over TP shards)."""
        return self.scaling in (Scaling.TENSOR, Scaling.BLOCK_E4M3_TENSOR)

    @property
    def quantizes(self) -> bool:
        """False for bf16 (the identity)."""
        return self.scaling is not Scaling.NONE


_BASE_FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("bf16", 16, 0, None, False, "BF16 reference (no scaling)"),
        Format(
            "fp8", 8, 0, None, False, "E4M3 fwd / E5M2 grad, per-tensor current scaling",
            element=E4M3, grad_element=E5M2, scaling=Scaling.TENSOR,
        ),
        Format(
            "fp8_block", 8, 128, (128, 128), False, "E4M3, 1x128 tiles, 128x128 weight blocks, pow2 scales",
            element=E4M3, scaling=Scaling.BLOCK_POW2,
        ),
        Format(
            "mxfp8", 8, 32, None, False, "E4M3, 32-element blocks, E8M0 scales (OCP MX)",
            element=E4M3, scaling=Scaling.BLOCK_E8M0, e8m0_round_up=True,
        ),
        Format(
            "nvfp4", 4, 16, (16, 16), True, "E2M1, 16-element blocks, E4M3 scales x FP32 tensor scale",
            element=E2M1, scaling=Scaling.BLOCK_E4M3_TENSOR, stochastic_gradients=True, wgrad_hadamard=True,
        ),
        Format(
            "mxfp4", 4, 32, None, True, "E2M1, 32-element blocks, E8M0 scales (OCP MX)",
            element=E2M1, scaling=Scaling.BLOCK_E8M0, e8m0_round_up=False,
        ),
        Format(
            # The SNIP paper's FP4: the DeepSeek-V3 layout (fp8_block's tiles) with E2M1 elements.
            "fp4_block", 4, 128, (128, 128), True, "E2M1, 1x128 tiles, 128x128 weight blocks, FP32 scales",
            element=E2M1, scaling=Scaling.BLOCK_FP32, stochastic_gradients=True,
        ),
    )
}

# --- recipe variants ----------------------------------------------------------------
# An FP4 format's name may carry switches that flip one recipe choice each, in this order:
# "+sr"/"-sr" turns stochastic rounding of gradients on/off, "+rht"/"-rht" the wgrad Hadamard
# transform - e.g. "mxfp4+sr+rht" (the MXFP4 training recipe's backward), "nvfp4-sr-rht" (TE's
# ablation). A switch must change something ("nvfp4+sr" is just "nvfp4"), so each recipe has
# exactly one name and plans naming it hash the same everywhere.
_SWITCHES = {"sr": "stochastic_gradients", "rht": "wgrad_hadamard"}
_SWITCH_WORDS = {"stochastic_gradients": "stochastic rounding of gradients", "wgrad_hadamard": "the wgrad RHT"}
_VARIANT = re.compile(r"(?P<base>[a-z0-9_]+)(?P<switches>(?:[+-](?:sr|rht))+)")


def base_format_name(name: str) -> str:
    """The base format of a recipe variant (``"mxfp4+sr+rht"`` -> ``"mxfp4"``); a base name itself."""
    m = _VARIANT.fullmatch(name)
    return m["base"] if m is not None and name not in _BASE_FORMATS else name


@functools.cache
def recipe_variant(name: str) -> Format:
    """The Format a switched FP4 name (``"mxfp4+sr+rht"``) stands for; ValueError saying why not."""
    m = _VARIANT.fullmatch(name)
    if m is None or m["base"] not in _BASE_FORMATS:
        raise ValueError(f"unknown precision format {name!r}; choose one of {sorted(_BASE_FORMATS)}, or an FP4 "
                         f"format with recipe switches, e.g. 'mxfp4+sr+rht' or 'nvfp4-sr' (switches: +sr/-sr, "
                         f"+rht/-rht, in that order)")
    base = _BASE_FORMATS[m["base"]]
    if not base.is_fp4:
        raise ValueError(f"precision format {name!r}: recipe switches apply to the FP4 formats "
                         f"{sorted(f for f in _BASE_FORMATS if _BASE_FORMATS[f].is_fp4)}, not {base.name!r}")
    switches = re.findall(r"([+-])(sr|rht)", m["switches"])
    keys = [key for _, key in switches]
    if keys not in (["sr"], ["rht"], ["sr", "rht"]):
        raise ValueError(f"precision format {name!r}: give each switch once, sr before rht "
                         f"(e.g. {base.name}-sr-rht)")
    changes = {}
    for sign, key in switches:
        field, on = _SWITCHES[key], sign == "+"
        if getattr(base, field) == on:
            state = "already uses" if on else "does not use"
            raise ValueError(f"precision format {name!r}: {base.name} {state} {_SWITCH_WORDS[field]}; "
                             f"drop {sign}{key}")
        changes[field] = on
    words = ", ".join(f"{'with' if on else 'without'} {_SWITCH_WORDS[f]}" for f, on in changes.items())
    return replace(base, name=name, description=f"{base.description}; {words}", **changes)


class _FormatRegistry(Mapping):
    """Formats by name: iterating gives the base formats; lookup also resolves recipe variants."""

    def __init__(self, base: Mapping[str, Format]) -> None:
        self._base = dict(base)

    def __getitem__(self, name: str) -> Format:
        if name in self._base:
            return self._base[name]
        if not isinstance(name, str):
            raise KeyError(name)
        try:
            return recipe_variant(name)
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


class _Fp4Names(AbstractSet):
    """Names counted as FP4 in the FLOP share: the base FP4 formats (iteration) and their variants."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in FORMATS and FORMATS[name].is_fp4

    def __iter__(self) -> Iterator[str]:
        return (name for name, f in _BASE_FORMATS.items() if f.is_fp4)

    def __len__(self) -> int:
        return sum(1 for _ in self)


FORMATS: Mapping[str, Format] = _FormatRegistry(_BASE_FORMATS)
FP4_FORMATS = _Fp4Names()


def get_format(name: str) -> Format:
    """Look up a format (or an FP4 recipe variant) by name; ValueError naming the choices otherwise."""
    if isinstance(name, str) and name in _BASE_FORMATS:
        return _BASE_FORMATS[name]
    if not isinstance(name, str):
        # ValueError, not TypeError: a wrong type here is bad user input, which the house reports as ValueError
        raise ValueError(f"precision format {name!r} must be a name (a string), one of {sorted(_BASE_FORMATS)}")  # noqa: TRY004
    return recipe_variant(name)
