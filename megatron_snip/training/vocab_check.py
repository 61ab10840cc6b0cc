"""Start-up check that the model's vocabulary covers the tokenizer (before any token is embedded).

That the data was made with this tokenizer is checked where the data is opened
(``data.pipeline.open_indexed``); together they keep an id from indexing past the embedding
(an IndexError on CPU, a device assert on GPU).
"""

from __future__ import annotations

from megatron_snip.config import Config
from megatron_snip.data.tokenizer import Tokenizer
from megatron_snip.model.llama import pad_vocab


def model_vocab_size(cfg: Config, tokenizer: Tokenizer, tp: int) -> int:
    """The model's vocabulary V: ``model.vocab_size``, or the tokenizer's padded one when 0.

    V must cover every id the tokenizer can produce (``raw_vocab_size``; an HF model's V may be
    below the tokenizer's padded size) and split evenly over TP."""
    vocab = cfg.model.vocab_size or pad_vocab(tokenizer.vocab_size)
    if vocab < tokenizer.raw_vocab_size:
        raise ValueError(f"config model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer.raw_vocab_size} ids ({tokenizer!r}); set it to 0 to take the tokenizer's, or use "
                         f"the tokenizer the model was trained with (data.tokenizer_path)")
    if vocab % tp:
        raise ValueError(f"config model.vocab_size={vocab} must be divisible by parallel.tp={tp} "
                         f"(vocab-parallel embedding); set it to a multiple of {64 * tp}")
    return vocab
