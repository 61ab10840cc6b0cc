"""The Llama model: layers (Column/RowParallelLinear, vocab-parallel embedding and loss, TP state-dict
sharding), norm, RoPE, shapes (parameter counts and FLOPs: their one home), recompute.

May import: config, parallel, precision (it uses a precision, never chooses one); never snip,
training or the entry points.
"""
