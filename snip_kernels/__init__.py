"""Triton kernels for megatron_snip: fused quantize-dequantize, bit-identical to the reference.

``snip_kernels.quantize.launch_qdq`` runs the block scaling of ``precision.quantize.blocks._qdq`` on
plain tensors and plain constants (ints, floats, bools); ``precision/quantize/kernel_calls.py``
turns a format and operand kind into them, and ``precision.quantize.compiled`` routes CUDA
operands there when Triton imports (``pip install -e ".[kernels]"``). CPU tests run it under the
Triton interpreter (``TRITON_INTERPRET=1``, set before the first import of ``snip_kernels.quantize``).

May import: torch and triton only; nothing of megatron_snip (precision imports kernels, never
the reverse).
"""
