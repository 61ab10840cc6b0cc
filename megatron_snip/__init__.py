"""megatron_snip: a Megatron-style Llama trainer with SNIP per-GEMM precision.

Owns the rooms below it and, at its root, only the entry points (train.py, evaluate.py,
launcher.py) and atomic_io.py; imports point one way (tests/unit/test_import_graph.py): precision,
then config and parallel, then model, data, telemetry, then snip, sizing, interop, then training,
then the entry points.
"""
