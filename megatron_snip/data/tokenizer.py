"""Tokenizers: text <-> token ids, behind one small interface.

Two kinds:
  * ``ByteTokenizer`` -- ids 0..255 are the UTF-8 bytes, 256 is the end-of-document (EOD)
    token. Needs no training and never fails on any text. ``vocab_size`` is padded up to a
    multiple of ``pad_to`` (default 64, giving 320) so the embedding shards evenly; the
    padding ids are never produced and decode to nothing.
  * ``BPETokenizer`` -- any HF ``tokenizers`` model: a byte-level BPE trained here (GPT-2 style
    pre-tokenization, lossless round trip, EOD ``<|endoftext|>``), or any ``tokenizer.json``
    loaded from a file - GPT-2 BPE, Llama-2's SentencePiece BPE with byte fallback, Llama-3's
    tiktoken-style BPE. Its end-of-document (EOD) and beginning-of-sequence (BOS) tokens are
    given by name or read from the tokenizer's own special tokens (``special_tokens``).

``build_tokenizer(kind, path, texts=...)`` is the one entry point configs use.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence

from megatron_snip.data.indexed import publish

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_KINDS = ("byte", "bpe")
TOKENIZER_CONFIG = "tokenizer_config.json"  # HF's file next to tokenizer.json naming bos_token / eos_token
# Special tokens recognised by name when a tokenizer.json comes without a tokenizer_config.json
# (GPT-2 / ours, Llama 3, Llama 2), in that order.
KNOWN_EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>")
KNOWN_BOS_TOKENS = ("<|begin_of_text|>", "<s>")
NO_TOKEN = "none"  # data.bos_token = "none": no BOS even if the tokenizer declares one


def _pad_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_pad_to(pad_to: int) -> None:
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ValueError(f"pad_to={pad_to!r} must be a positive int (e.g. 64 or 128)")


class Tokenizer(abc.ABC):
    """Common interface.

    Attributes:
        vocab_size: size of the id space the model must embed (padded; every id the tokenizer
            produces is < vocab_size).
        raw_vocab_size: number of ids the tokenizer can actually produce.
        eod_id: end-of-document id, appended after each document when building datasets.
        bos_id: beginning-of-sequence id that ``encode`` puts before each document, or None.
        kind: "byte" or "bpe".
    """

    kind: str
    vocab_size: int
    raw_vocab_size: int
    eod_id: int
    bos_id: int | None = None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: BOS first when the tokenizer has one, no EOD appended."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, faster where the backend allows."""
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; EOD and padding ids decode to nothing."""

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Write a file that ``load_tokenizer(path)`` reads back into an equal tokenizer."""

    @abc.abstractmethod
    def identity(self) -> str:
        """A stable hex digest naming the exact token mapping (used as a cache key)."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is EOD, vocab padded to ``pad_to``."""

    kind = "byte"

    def __init__(self, pad_to: int = 64) -> None:
        _check_pad_to(pad_to)
        self.pad_to = pad_to
        self.eod_id = 256
        self.raw_vocab_size = 257
        self.vocab_size = _pad_up(self.raw_vocab_size, pad_to)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # Ids >= 256 are EOD or padding; a window may cut a multi-byte char, hence "replace".
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        _atomic_write_text(path, json.dumps({"kind": "byte", "pad_to": self.pad_to}) + "\n")

    def identity(self) -> str:
        return hashlib.sha256(f"byte-v1-pad{self.pad_to}".encode()).hexdigest()

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class BPETokenizer(Tokenizer):
    """Byte-level BPE (HF ``tokenizers``); lossless on any UTF-8 text.

    Build with ``BPETokenizer.train(texts, vocab_size)`` or ``BPETokenizer.from_file(path)``.
    """

    kind = "bpe"

    def __init__(self, hf_tokenizer, eod_token: str = EOD_TOKEN, pad_to: int = 64, bos_token: str | None = None) -> None:
        """``eod_token``/``bos_token``: names of special tokens in the vocabulary (``bos_token``
        None: no BOS). ``special_tokens`` resolves them from a tokenizer's own files."""
        _check_pad_to(pad_to)
        self._tok = hf_tokenizer
        self.eod_token, self.bos_token = eod_token, bos_token
        self.eod_id = self._id_of(eod_token, "eod_token")
        self.bos_id = None if bos_token is None else self._id_of(bos_token, "bos_token")
        self.pad_to = pad_to
        self.raw_vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))
        self.vocab_size = _pad_up(self.raw_vocab_size, pad_to)

    def _id_of(self, token: str, field: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
            raise ValueError(f"{field}={token!r} is not in the tokenizer's vocabulary; set data.{field} "
                             f"(preprocess_data.py --{field.replace('_', '-')}) to one of its special tokens: {specials}")
        return int(tid)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        min_frequency: int = 2,
        pad_to: int = 64,
        show_progress: bool = False,
    ) -> BPETokenizer:
        """Train a byte-level BPE with ``vocab_size`` ids (256 byte symbols + EOD + merges).

        Args:
            texts: training documents (any iterable of str; consumed once).
            vocab_size: target vocabulary including the 256 byte symbols and EOD; at least 258.
                Fewer ids result if the text has too few distinct pairs to merge.
            min_frequency: a pair must occur this often to be merged.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if not isinstance(vocab_size, int) or vocab_size < 258:
            raise ValueError(
                f"vocab_size={vocab_size!r} is too small for byte-level BPE; "
                f"use at least 258 (256 bytes + EOD + 1 merge), e.g. 4096"
            )
        tok = HFTokenizer(models.BPE())
        # add_prefix_space=False keeps encode/decode an exact round trip.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOD_TOKEN],
            # every byte is a symbol, so unseen characters still encode
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, EOD_TOKEN, pad_to)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eod_token: str = "", pad_to: int = 64,
                  bos_token: str = "") -> BPETokenizer:
        """Load any HF ``tokenizer.json``; ``eod_token``/``bos_token`` "" = the tokenizer's own
        (see ``special_tokens``), ``bos_token`` "none" = no BOS."""
        from tokenizers import Tokenizer as HFTokenizer

        if not os.path.isfile(path):
            raise ValueError(f"tokenizer path={str(path)!r} does not exist; train one with build_tokenizer('bpe', path, texts=...)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says what is wrong with the JSON
            raise ValueError(f"tokenizer path={str(path)!r} is not a valid HF tokenizer.json: {e}") from e
        eod, bos = special_tokens(tok, _declared_specials(path), eod_token, bos_token)
        return cls(tok, eod, pad_to, bos)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: the file's post-processor (e.g. Llama's TemplateProcessing) does
        # not add its BOS; we add ours, so every tokenizer behaves the same way.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # Rust-side, multi-threaded over documents.
        out = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        return out if self.bos_id is None else [[self.bos_id, *ids] for ids in out]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [i for i in map(int, ids) if 0 <= i < self.raw_vocab_size and i not in (self.eod_id, self.bos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        _atomic_write_text(path, self._tok.to_str())

    def hf_files(self) -> dict[str, str]:
        """File name -> text of an HF tokenizer (tokenizer.json + a tokenizer_config.json naming
        our BOS/EOS), for exported model directories."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eod_token,
                  "bos_token": self.bos_token, "add_bos_token": self.bos_token is not None}
        return {"tokenizer.json": self._tok.to_str(), TOKENIZER_CONFIG: json.dumps(config, indent=1) + "\n"}

    def identity(self) -> str:
        bos = "" if self.bos_token is None else f"-bos{self.bos_token}"
        return hashlib.sha256(f"bpe-v1-pad{self.pad_to}-{self.eod_token}{bos}\n".encode()
                              + self._tok.to_str().encode()).hexdigest()

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, raw={self.raw_vocab_size}, eod={self.eod_token!r} "
                f"({self.eod_id}), bos={self.bos_token!r} ({self.bos_id}))")


def _declared_specials(tokenizer_json: str | os.PathLike) -> dict[str, str]:
    """bos_token / eos_token named by the tokenizer_config.json next to ``tokenizer_json`` ({} if none)."""
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_json)), TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}); fix or remove it (it names the tokenizer's bos/eos tokens)") from e
    out = {}
    for key in ("bos_token", "eos_token"):
        v = cfg.get(key)
        if isinstance(v, dict):  # {"content": "<s>", ...} (AddedToken form)
            v = v.get("content")
        if isinstance(v, str) and v:
            out[key] = v
    return out


def special_tokens(hf_tokenizer, declared: dict[str, str], eod_token: str = "", bos_token: str = ""
                   ) -> tuple[str, str | None]:
    """(EOD token, BOS token or None) for a tokenizer.

    ``eod_token`` "" -> the declared ``eos_token`` (tokenizer_config.json), else the first of
    ``KNOWN_EOD_TOKENS`` in the vocabulary. ``bos_token`` "" -> the declared ``bos_token``, else
    the first of ``KNOWN_BOS_TOKENS``, else none; "none" -> no BOS. A BOS equal to the EOD (GPT-2
    declares both as <|endoftext|>) is dropped: the EOD already separates documents."""
    def present(t: str) -> bool:
        return hf_tokenizer.token_to_id(t) is not None

    eod = eod_token or declared.get("eos_token") or next((t for t in KNOWN_EOD_TOKENS if present(t)), None)
    if eod is None:
        specials = [t.content for t in hf_tokenizer.get_added_tokens_decoder().values() if t.special]
        raise ValueError(f"the tokenizer has none of the end-of-document tokens {list(KNOWN_EOD_TOKENS)} and no "
                         f"{TOKENIZER_CONFIG} naming its eos_token; set data.eod_token (preprocess_data.py "
                         f"--eod-token) to one of its special tokens: {specials}")
    if bos_token == NO_TOKEN:
        return eod, None
    bos = bos_token or declared.get("bos_token") or next((t for t in KNOWN_BOS_TOKENS if present(t)), None)
    return eod, (None if bos == eod else bos)


def load_tokenizer(path: str | os.PathLike, pad_to: int = 64) -> Tokenizer:
    """Read a file written by ``Tokenizer.save`` (byte spec or BPE tokenizer.json)."""
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer path={str(path)!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tokenizer path={str(path)!r} is not JSON ({e}); expected a file written by Tokenizer.save") from e
    if isinstance(spec, dict) and spec.get("kind") == "byte":
        return ByteTokenizer(pad_to=int(spec.get("pad_to", pad_to)))
    return BPETokenizer.from_file(path, pad_to=pad_to)


def build_tokenizer(
    kind: str,
    path: str | os.PathLike | None = None,
    texts: Iterable[str] | None = None,
    vocab_size: int = 4096,
    pad_to: int = 64,
    eod_token: str = "",
    bos_token: str = "",
) -> Tokenizer:
    """The tokenizer a config asks for.

    Args:
        kind: "byte" or "bpe".
        path: for "bpe", the ``tokenizer.json`` to load; if it does not exist, a tokenizer is
            trained on ``texts`` and saved there (atomically, so concurrent ranks are safe).
            Ignored for "byte".
        texts: training documents, needed only when a BPE must be trained.
        vocab_size: BPE training target.
        pad_to: ``vocab_size`` is padded to a multiple of this.
        eod_token, bos_token: for a loaded "bpe", the special tokens by name ("" = the
            tokenizer's own, see ``special_tokens``; bos "none" = no BOS). A trained BPE always
            uses ``<|endoftext|>`` as EOD and no BOS.
    """
    if kind == "byte":
        return ByteTokenizer(pad_to=pad_to)
    if kind != "bpe":
        raise ValueError(f"tokenizer kind={kind!r} is unknown; use one of {TOKENIZER_KINDS}")
    if path is not None and os.path.isfile(path):
        return BPETokenizer.from_file(path, eod_token=eod_token, pad_to=pad_to, bos_token=bos_token)
    if texts is None:
        raise ValueError(
            f"tokenizer kind='bpe' with path={None if path is None else str(path)!r}: no tokenizer file "
            f"to load and no texts to train on; pass an existing tokenizer.json path or texts=..."
        )
    tok = BPETokenizer.train(texts, vocab_size=vocab_size, pad_to=pad_to)
    if path is not None:
        tok.save(path)
    return tok


def _atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder + rename (never half-written)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
