"""Telemetry: the rank-0 logger, the run reader, plots, W&B and TensorBoard sinks, the host-sync counter.

May import: config, precision; never model, snip, training or the entry points.
"""
