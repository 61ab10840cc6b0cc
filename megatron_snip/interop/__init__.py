"""Interoperability with other frameworks' checkpoints (Hugging Face Llama: ``interop.hf``): pure
conversion between our state dicts / ModelConfig and HF tensors / config.json, and reading HF
directories. Reading or writing *our* checkpoints is training's (training/export_hf.py).

May import: config; never training or the entry points.
"""
