"""Data: tokenizers, .bin/.idx token files (+ fingerprint), datasets, blends, corpora, the batch pipeline.

May import: config, atomic_io; never model, snip, training or the entry points.
"""
