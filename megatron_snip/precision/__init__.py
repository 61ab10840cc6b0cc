"""Precision: formats, operand-shape rules, the reference quantizers (quantize/), quant_linear, the plan,
the capability table and the scaled-mm rules (pure: ``capability.py``, ``scaled_mm_rules.py``),
backends (emulated, torch scaled-mm, TE; ``backends/support.py``: the start-up verdicts that probe
this device), fallbacks, weight copies.

The bottom room: may import snip_kernels (the Triton quantizers, lazily, through
quantize/kernel_calls.py); nothing else of megatron_snip. Inside it no module imports one above
it (no circle: tests/unit/test_import_graph.py), bottom up: formats, plan, gemm_shapes,
scaled_mm_rules, quantize/, gemm; capability; backends/base; backends/emulated and scaled_mm;
backends/support; backends/te (its start-up check); backends/__init__ (get_backend).
"""
