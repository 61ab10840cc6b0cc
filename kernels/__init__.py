"""Triton kernels for megatron_snip: fused quantize-dequantize, bit-identical to the reference.

``kernels.quantize.qdq`` is the kernel counterpart of ``precision.quantize.blocks._qdq``
(same arguments, same bits); ``precision.quantize.compiled`` routes CUDA operands to it when
Triton imports (``pip install -e ".[kernels]"``). CPU tests run it under the Triton
interpreter (``TRITON_INTERPRET=1``, set before the first import of ``kernels.quantize``).
"""
