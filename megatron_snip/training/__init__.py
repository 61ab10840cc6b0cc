"""Training: the trainer, optimizer, LR schedule, checkpoints (read, reshard, resume checks), init_from,
exporting our checkpoints to Hugging Face (export_hf.py), preemption, throughput, run directories.

May import every room below it (precision, config, parallel, model, data, telemetry, snip,
sizing, interop) and atomic_io; never the entry points.
"""
