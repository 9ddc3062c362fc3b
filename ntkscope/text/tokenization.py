"""Tokenizers behind one small interface: a BPE trained on a corpus pack, GPT-2's own BPE
(through ``tiktoken``, from the ranks file that ships in the ``openai-whisper`` sdist), and
the ``tokenizer.json`` of any HF checkpoint (e.g. MiniLM's WordPiece).

Every tokenizer here encodes *without* adding special tokens: frequency counts and
sentence scores see only the text's own tokens.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ntkscope.core.checks import InputError, MissingInput, MissingPackage, UserError, fail
from ntkscope.core.paths import default_data_dir

log = logging.getLogger(__name__)

#: Special tokens of the BPE trained on a pack (GPT-2's end-of-text, then pad, mask, unk).
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<pad>", "<mask>", "<unk>")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = 50256


@dataclass(frozen=True)
class TextTokenizer:
    """A tokenizer with what frequency analysis needs.

    Attributes
    ----------
    name : where it came from (a path, or ``gpt2``).
    vocab_size : ids are in ``[0, vocab_size)``.
    special_ids : ids never counted (special, padding, mask, end-of-text).
    unk_id : the unknown token's id, or None when every byte has a token.
    backend : the ``tokenizers.Tokenizer`` or ``tiktoken.Encoding`` underneath.
    """

    name: str
    vocab_size: int
    special_ids: frozenset
    unk_id: int | None
    backend: object

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added. Runs in parallel in Rust."""
        if isinstance(texts, str):  # list("a string") would encode it character by character
            raise InputError("texts", "must be a sequence of strings (one string: pass [text])", texts[:40],
                             func="TextTokenizer.encode")
        texts = list(texts)
        if hasattr(self.backend, "encode_ordinary_batch"):  # tiktoken
            return self.backend.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
        encoded = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids))

    @property
    def pad_id(self) -> int | None:
        """The padding id: ``<pad>`` (or ``[PAD]``) when there is one, else end-of-text."""
        backend = self.backend
        if hasattr(backend, "token_to_id"):
            for token in ("<pad>", "[PAD]", "<|endoftext|>"):
                if backend.token_to_id(token) is not None:
                    return backend.token_to_id(token)
        return GPT2_EOT if self.name == "gpt2" else None


def _from_hf(tokenizer, name: str) -> TextTokenizer:
    tokenizer.no_padding()  # checkpoints often ship with padding/truncation to 128 switched on
    tokenizer.no_truncation()
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    special_ids = frozenset(tokenizer.token_to_id(t) for t in specials)
    unk_token = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk_token) if unk_token else None
    return TextTokenizer(name, tokenizer.get_vocab_size(with_added_tokens=True), special_ids, unk_id, tokenizer)


def train_bpe(texts: Sequence[str], *, vocab_size: int = 8192, min_frequency: int = 2) -> TextTokenizer:
    """A byte-level BPE (GPT-2 style) trained on ``texts`` with HF ``tokenizers``.

    Ids 0..3 are :data:`BPE_SPECIAL_TOKENS`; every byte has a token, so nothing is unknown.
    """

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256 + len(BPE_SPECIAL_TOKENS):
        raise UserError(f"train_bpe: vocab_size must be an integer >= {256 + len(BPE_SPECIAL_TOKENS)} "
                        f"(256 bytes + special tokens) (got {vocab_size!r})")
    texts = list(texts)
    if not any(t.strip() for t in texts):
        raise UserError(f"train_bpe: texts must hold some non-blank text (got {len(texts)} blank texts)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(BPE_SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return _from_hf(tokenizer, "bpe")


def gpt2_tokenizer(ranks: str | Path) -> TextTokenizer:
    """GPT-2's BPE (50,257 ids) from a ``gpt2.tiktoken`` ranks file, through ``tiktoken``."""
    try:
        import tiktoken  # optional: only GPT-2's ranks file needs it
        from tiktoken.load import load_tiktoken_bpe  # optional, as above
    except ImportError:
        raise MissingPackage("gpt2_tokenizer: needs tiktoken: pip install tiktoken") from None
    ranks = Path(ranks)
    if not ranks.is_file():
        raise MissingInput(
            f"gpt2_tokenizer: ranks file {ranks} is missing; get it with scripts/fetch_sources.sh gpt2 "
            "(it ships in the openai-whisper==20250625 sdist as whisper/assets/gpt2.tiktoken)")
    encoding = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(ranks)),
                                 special_tokens={"<|endoftext|>": GPT2_EOT})
    return TextTokenizer("gpt2", encoding.n_vocab, frozenset({GPT2_EOT}), None, encoding)


def load_tokenizer(spec: str | Path) -> TextTokenizer:
    """A tokenizer from a ``tokenizer.json``, a directory holding one (an HF checkpoint or a
    corpus pack), a ``*.tiktoken`` ranks file, or ``"gpt2"`` (the ranks file in the sources
    directory, ``$NTKSCOPE_SOURCES/gpt2.tiktoken``)."""
    if not isinstance(spec, (str, os.PathLike)):
        raise fail("load_tokenizer", "spec", "must be a tokenizer.json path, a directory holding one, a .tiktoken ranks "
                   "file or 'gpt2' (a tokenizer object needs no loading: pass it where a tokenizer is asked for)",
                   type(spec).__name__)
    if str(spec) == "gpt2":
        return gpt2_tokenizer(default_data_dir() / "gpt2.tiktoken")
    path = Path(spec)
    if path.suffix == ".tiktoken":
        return gpt2_tokenizer(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise MissingInput(f"load_tokenizer: spec must be a tokenizer.json, a directory holding one, "
                           f"a .tiktoken ranks file or 'gpt2'; {path} does not exist (got {str(spec)!r})")
    try:
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.encode(PROBE_TEXT)  # a pre-tokenizer whose pattern fails at its first use fails here, not mid-run
    except BaseException as err:  # tokenizers raises a bare Exception on a malformed file, or panics in Rust
        if not isinstance(err, Exception) and type(err).__name__ != "PanicException":
            raise  # KeyboardInterrupt, SystemExit: not the file's fault
        shown = " ".join(str(err).split())[:200]
        raise UserError(f"load_tokenizer: {path} is not a tokenizers JSON file that can encode text "
                        f"({shown})") from None
    return _from_hf(tokenizer, str(Path(spec)))


PROBE_TEXT = "A probe sentence: its words, 123 digits and punctuation (a tokenizer must encode it)."


def as_tokenizer(tokenizer) -> TextTokenizer:
    """What a user has, as a :class:`TextTokenizer`: one already; a path or name
    (:func:`load_tokenizer`); a ``tokenizers.Tokenizer``; or a transformers fast tokenizer (its
    backend, copied: the user's object keeps its padding and truncation)."""
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if isinstance(backend, Tokenizer):
        name = str(getattr(tokenizer, "name_or_path", "") or "tokenizers.Tokenizer")
        return _from_hf(Tokenizer.from_str(backend.to_str()), name)
    raise InputError("tokenizer", "must be a TextTokenizer, a tokenizer.json path or a directory holding one, 'gpt2', "
                     "a tokenizers.Tokenizer or a transformers fast tokenizer", type(tokenizer).__name__)
