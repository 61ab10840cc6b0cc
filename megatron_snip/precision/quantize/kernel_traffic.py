"""The device-memory bytes each call of ``kernel_calls`` moves: one function per call path.

A bandwidth figure is only as true as its byte count: ``scripts/gpu_check.py``'s ``kernel_bw``
divides these bytes by the measured time of the same call and compares the rate with the copy
bandwidth. Each function below walks the same branches as its call (``kernel_calls.qdq``,
``kernel_calls.scaled_operand``) and lists the passes over device memory it launches, each as
(what, bytes read, bytes written). N = rows * cols elements; e = the input's element size (fp32:
4, bf16: 2). Tensors of at most ``SMALL_TENSOR`` elements (the 4-float scalars, the 0-d amax,
the two seeds) are left out: under 100 bytes per call.

``qdq`` (fp32 in, fp32 out):
  * the kernel: reads the operand (4N) and writes the dequantized result (4N);
  * a tensor scale (``fp8``, ``nvfp4``) with no amax given: ``p.abs()`` reads 4N and writes a
    4N |p| temporary, ``.amax()`` reads it again (4N): +12N;
  * the Hadamard rotation in a pass of its own (tensor scale without a given amax, or blocks
    that are not the rotated 16-blocks): a rotation kernel reads 4N and writes 4N, and the
    amax and the quantize kernel then read the rotated copy: +8N.
  So ``fp8`` / ``nvfp4`` activations move 20N, ``nvfp4`` gradients with RHT 28N, the block
  formats 8N.
``scaled_operand`` (e-byte input, float8 elements out):
  * the kernel: reads eN, writes N float8 elements and, for block scales, (rows/br)(cols/bc)
    fp32 decode scales;
  * ``fp8`` with no amax given: ``x.abs()`` reads eN and writes eN, ``.amax()`` reads eN: +3eN.

tests/unit/test_kernel_traffic.py checks every function against the bytes the call's torch ops
and kernel launches really touch (counted under the Triton interpreter), so a change to a call
path that does not update its function here fails that test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_snip.precision.formats import Format, Operand, Scaling

__all__ = ["SMALL_TENSOR", "Traffic", "qdq_traffic", "scaled_operand_traffic"]

SMALL_TENSOR = 16  # elements: scalars, seeds and 0-d amaxes below this are not counted


@dataclass(frozen=True)
class Traffic:
    """The passes over device memory of one call: ((what, bytes read, bytes written), ...)."""

    passes: tuple[tuple[str, int, int], ...]

    @property
    def bytes(self) -> int:
        """Bytes read + written by the whole call."""
        return sum(r + w for _, r, w in self.passes)

    def describe(self, numel: int) -> str:
        """e.g. "20.0 B/elem: abs 8.0, amax 4.0, kernel 8.0" for ``numel`` elements."""
        parts = ", ".join(f"{what} {(r + w) / numel:.1f}" for what, r, w in self.passes)
        return f"{self.bytes / numel:.1f} B/elem: {parts}"


def _amax_passes(numel: int, elem_bytes: int) -> list[tuple[str, int, int]]:
    # x.abs() materializes |x| (read + write), .amax() reads it again; the 0-d result is small.
    return [("abs", numel * elem_bytes, numel * elem_bytes), ("amax", numel * elem_bytes, 0)]


def qdq_traffic(spec: Format, operand: Operand, hadamard: bool, amax_given: bool, rows: int, cols: int,
                *, separate_rotation: bool | None = None) -> Traffic:
    """The bytes ``kernel_calls.qdq`` moves on a contiguous fp32 (rows, cols) operand.

    Args:
        spec, operand, hadamard: as ``qdq`` takes them.
        amax_given: ``qdq``'s ``amax`` is not None (a TP-reduced amax handed in).
        separate_rotation: the rotation runs as its own pass; None asks ``kernel_calls.separate_rotation``.
    """
    n = rows * cols
    passes: list[tuple[str, int, int]] = []
    if separate_rotation is None:  # kernel_calls imports Triton: only asked where a rotation may run
        from megatron_snip.precision.quantize.kernel_calls import separate_rotation as rotates

        separate_rotation = hadamard and rotates(spec, operand, hadamard, amax_given)
    if separate_rotation:
        passes.append(("rotation", 4 * n, 4 * n))
    if spec.scaling in (Scaling.TENSOR, Scaling.BLOCK_E4M3_TENSOR) and not amax_given:
        passes += _amax_passes(n, 4)
    passes.append(("kernel", 4 * n, 4 * n))
    return Traffic(tuple(passes))


def scaled_operand_traffic(spec: Format, operand: Operand, amax_given: bool, rows: int, cols: int,
                           in_dtype: torch.dtype) -> Traffic:
    """The bytes ``kernel_calls.scaled_operand`` moves on a (rows, cols) operand of ``in_dtype``.

    Args:
        spec: ``fp8`` (tensor scale) or ``fp8_block`` (power-of-two block scales).
        amax_given: ``scaled_operand``'s ``amax`` is not None.
    """
    n, e = rows * cols, torch.empty((), dtype=in_dtype).element_size()
    passes: list[tuple[str, int, int]] = []
    written = n  # float8 elements
    if spec.scaling is Scaling.TENSOR:
        if not amax_given:
            passes += _amax_passes(n, e)
    else:
        br, bc = spec.block_for(operand)
        n_scales = (rows // br) * (cols // bc)
        written += 4 * n_scales if n_scales > SMALL_TENSOR else 0
    passes.append(("kernel", e * n, written))
    return Traffic(tuple(passes))
