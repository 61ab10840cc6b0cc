"""Precision: formats, operand-shape rules, the reference quantizers (quantize/), quant_linear, the plan,
backends (emulated, torch scaled-mm, TE), the capability table, fallbacks, weight copies.

The bottom room: may import kernels (the Triton quantizers, lazily, through
quantize/kernel_calls.py); nothing else of megatron_snip.
"""
