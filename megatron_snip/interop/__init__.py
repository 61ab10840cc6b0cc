"""Interoperability with other frameworks' checkpoints (Hugging Face Llama: ``interop.hf``)."""
