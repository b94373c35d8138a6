"""Schema of the `data` config group (see configs/data/*.yaml)."""
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


class Source(str, Enum):
    stdlib = "stdlib"  # .py files of the running Python's standard library (+ extra roots)
    files = "files"    # local txt / jsonl / parquet files, read through `datasets`
    hub = "hub"        # a Hugging Face hub dataset, streamed


@dataclass
class DataConfig:
    source: Source = Source.stdlib
    name: str = "stdlib"                 # names the shard directory under cache_dir
    # stdlib: extra source trees whose .py files are added to the standard library's
    roots: List[str] = field(default_factory=list)
    include_stdlib: bool = True
    # stdlib: also the running Python's installed packages (site-packages), e.g. a GPU machine's
    # torch, transformers, numpy... sources: a larger offline code corpus
    include_site_packages: bool = False
    # files: paths or globs of .txt, .jsonl/.json or .parquet files
    paths: List[str] = field(default_factory=list)
    # hub: dataset path and config name, e.g. HuggingFaceFW/fineweb-edu, sample-10BT
    hub_path: str = ""
    hub_name: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    max_documents: Optional[int] = None  # stop reading after this many documents
    # tokenizer: "bpe" trains a byte-level BPE of `vocab_size` on the corpus;
    # anything else is the path of a tokenizer.json to load
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    tokenizer_train_documents: int = 200_000  # BPE is trained on at most this many documents
    val_fraction: float = 0.005          # fraction of documents held out for validation
    shard_tokens: int = 100_000_000      # tokens per shard file
    cache_dir: str = "data_cache"        # relative paths are taken from the repository root
    shard_dir: Optional[str] = None      # None: <cache_dir>/<name>-<tokenizer tag>
