"""Data pipeline: corpus -> byte-level BPE -> token shards -> deterministic batches."""
from .config import DataConfig, Source
from .errors import DataError
from .loader import TokenLoader, batch_to_device
from .shards import Manifest, load_manifest, prepare, shard_dir_for
from .tokenizer import EOT, load_tokenizer, tokenizer_sha256, train_bpe

__all__ = [
    "DataConfig", "Source", "DataError", "TokenLoader", "batch_to_device", "Manifest", "load_manifest", "prepare",
    "shard_dir_for", "EOT", "load_tokenizer", "tokenizer_sha256", "train_bpe",
]
