"""One-element Triton probes of the compiler's numerics (``scripts/gpu_check_probes.py`` runs them).

``div_rn``: does ``tl.div_rn`` keep subnormal results and inputs? The quantize kernels take
every block scale from one correctly rounded division (``snip_kernels/quantize.py``), and their
bitwise equality with the reference needs IEEE subnormals; Triton's NVIDIA backend has an
``enable_reflect_ftz`` option (default True: libdevice in flush-to-zero mode) whose effect on
``div_rn`` the interpreter cannot show. Imports nothing of megatron_snip, like the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["div_rn"]


@triton.jit
def _div_rn_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.div_rn(tl.load(x_ptr + i), tl.load(y_ptr + i)))


def div_rn(x, y, out, **options) -> None:
    """out = tl.div_rn(x, y) elementwise for fp32 tensors of one power-of-two length, launched with
    the Triton compile ``options`` given (e.g. ``enable_fp_fusion=False, enable_reflect_ftz=False``)."""
    _div_rn_kernel[(1,)](x, y, out, N=x.numel(), **options)
