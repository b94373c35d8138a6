"""Byte-level BPE: train, load, and fingerprint tokenizers."""
import hashlib
from pathlib import Path
from typing import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from .errors import DataError

EOT = "<|endoftext|>"  # special token appended after every document

# 256 byte symbols + EOT: BPE cannot have fewer tokens than this
MIN_VOCAB_SIZE = 257


def train_bpe(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train a byte-level BPE (lossless on any text) with EOT as its special token."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"data.vocab_size={vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB_SIZE}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        # every byte gets a token even if the training texts never contain it
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path) -> tokenizers.Tokenizer:
    """Load a tokenizer.json; DataError naming the path if it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist (data.tokenizer must be 'bpe' or the path of a tokenizer.json)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception with a parse message
        raise DataError(f"tokenizer file {path} is not a readable tokenizer.json: {e}") from e


def tokenizer_sha256(tok: tokenizers.Tokenizer) -> str:
    """Hash of the canonical serialization, so equal tokenizers hash equal whatever their file formatting."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
