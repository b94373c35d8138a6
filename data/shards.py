"""Tokenize a corpus once into flat binary token shards plus a manifest, and verify them on reuse."""
import itertools
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, List, Tuple

import numpy as np
from tqdm import tqdm

from .config import DataConfig
from .errors import DataError
from .sources import describe_source, iter_documents, source_of
from .tokenizer import EOT, load_tokenizer, tokenizer_sha256, train_bpe

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
VERSION = 1
SPLITS = ("train", "val")
_ENCODE_BATCH = 1000  # documents per encode_batch call: large enough to use all cores


@dataclass
class Manifest:
    """Contents of manifest.json; written last, so its presence means the shards are complete."""
    version: int
    tokenizer_sha256: str
    vocab_size: int
    eot_id: int
    dtype: str            # "uint16" when vocab_size <= 65536, else "uint32"
    splits: dict          # {"train": [{"file": ..., "tokens": int}, ...], "val": [...]}
    documents: dict       # {"train": n, "val": n}
    source: str           # what was read (source, paths/roots, max_documents)

    def tokens(self, split) -> int:
        return sum(s["tokens"] for s in self.splits[split])


def token_dtype(vocab_size: int) -> str:
    """Smallest unsigned dtype that holds every token id."""
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def _tokenizer_path(cfg: DataConfig, base_dir: Path) -> Path:
    p = Path(cfg.tokenizer)
    return p if p.is_absolute() else Path(base_dir) / p


def shard_dir_for(cfg: DataConfig, base_dir: Path) -> Path:
    """Where cfg's shards live: cfg.shard_dir, else a name under cache_dir tagged by the tokenizer."""
    base_dir = Path(base_dir)
    if cfg.shard_dir:
        p = Path(cfg.shard_dir)
        return p if p.is_absolute() else base_dir / p
    cache = Path(cfg.cache_dir)
    cache = cache if cache.is_absolute() else base_dir / cache
    if cfg.tokenizer == "bpe":
        return cache / f"{cfg.name}-bpe{cfg.vocab_size}"
    path = _tokenizer_path(cfg, base_dir)
    sha = tokenizer_sha256(load_tokenizer(path))
    return cache / f"{cfg.name}-{path.stem}-{sha[:8]}"


def load_manifest(shard_dir: Path) -> Manifest:
    """Read manifest.json and check every shard file exists with the size the manifest records."""
    shard_dir = Path(shard_dir)
    path = shard_dir / MANIFEST
    try:
        raw = json.loads(path.read_text())
        m = Manifest(**raw)
    except FileNotFoundError:
        raise DataError(f"{path} is missing: {shard_dir} is not a prepared shard directory") from None
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{path} is unreadable ({e}); delete {shard_dir} to prepare it again") from e
    if m.version != VERSION:
        raise DataError(f"{path} has version {m.version}, this code reads version {VERSION}; delete {shard_dir} to prepare it again")
    itemsize = np.dtype(m.dtype).itemsize
    for split in SPLITS:
        for s in m.splits.get(split, []):
            f = shard_dir / s["file"]
            if not f.is_file():
                raise DataError(f"shard {f} is missing; delete {shard_dir} to prepare it again")
            size, want = f.stat().st_size, s["tokens"] * itemsize
            if size != want:
                raise DataError(f"shard {f} is truncated: {size} bytes, manifest says {want}; delete {shard_dir} to prepare it again")
    return m


def prepare(cfg: DataConfig, base_dir: Path, progress: bool = True) -> Tuple[Path, Manifest]:
    """Return (shard_dir, manifest), tokenizing the corpus first unless a matching cache exists."""
    base_dir = Path(base_dir)
    shard_dir = shard_dir_for(cfg, base_dir)
    if (shard_dir / MANIFEST).exists():
        return shard_dir, _check_cached(cfg, base_dir, shard_dir)
    if shard_dir.exists() and any(shard_dir.iterdir()):
        # never delete a directory we did not write: ours only appear complete (atomic replace)
        raise DataError(f"{shard_dir} exists but has no {MANIFEST}; delete it or set data.shard_dir / data.name elsewhere")

    _check_settings(cfg)
    shard_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shard_dir.name}.tmp-", dir=shard_dir.parent))
    try:
        manifest = _build(cfg, base_dir, tmp, progress)
        try:
            if shard_dir.exists():
                shard_dir.rmdir()  # empty (checked above); os.replace cannot replace a non-empty directory
            os.replace(tmp, shard_dir)
        except OSError:
            # another process (e.g. another rank) finished first: use its result
            if (shard_dir / MANIFEST).exists():
                return shard_dir, _check_cached(cfg, base_dir, shard_dir)
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return shard_dir, manifest


def _check_settings(cfg: DataConfig) -> None:
    if not 0 < cfg.val_fraction <= 0.5:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in (0, 0.5]")
    if cfg.shard_tokens < 1:
        raise DataError(f"data.shard_tokens={cfg.shard_tokens} must be >= 1")
    if cfg.tokenizer == "bpe" and cfg.tokenizer_train_documents < 1:
        raise DataError(f"data.tokenizer_train_documents={cfg.tokenizer_train_documents} must be >= 1")


def _check_cached(cfg: DataConfig, base_dir: Path, shard_dir: Path) -> Manifest:
    m = load_manifest(shard_dir)
    if cfg.tokenizer == "bpe":
        if m.vocab_size != cfg.vocab_size:
            raise DataError(
                f"{shard_dir} holds a BPE of vocab_size {m.vocab_size} but data.vocab_size={cfg.vocab_size}; "
                "delete it or set data.shard_dir elsewhere")
    else:
        sha = tokenizer_sha256(load_tokenizer(_tokenizer_path(cfg, base_dir)))
        if sha != m.tokenizer_sha256:
            raise DataError(
                f"{shard_dir} was made with tokenizer {m.tokenizer_sha256[:8]} but data.tokenizer={cfg.tokenizer} "
                f"is {sha[:8]}; delete it or set data.shard_dir elsewhere")
    want = describe_source(cfg)
    if m.source != want:
        raise DataError(
            f"{shard_dir} was prepared from {m.source} but the config reads {want}; "
            "delete it or set data.name / data.shard_dir elsewhere")
    return m


class _ShardWriter:
    """Streams one split's tokens into files of at most `shard_tokens` tokens."""

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.cap = out_dir, split, np.dtype(dtype), shard_tokens
        self.shards: List[dict] = []
        self.file = None
        self.documents = 0

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self.file is None or self.shards[-1]["tokens"] == self.cap:
                self._next_file()
            room = self.cap - self.shards[-1]["tokens"]
            chunk, ids = ids[:room], ids[room:]
            chunk.tofile(self.file)
            self.shards[-1]["tokens"] += len(chunk)

    def _next_file(self) -> None:
        if self.file is not None:
            self.file.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self.file = open(self.out_dir / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _batches(it: Iterator[str], n: int) -> Iterator[List[str]]:
    while batch := list(itertools.islice(it, n)):
        yield batch


def _drain(items: list) -> Iterator[str]:
    """Yield a list's items in order while releasing them (the BPE head can be large)."""
    items.reverse()
    while items:
        yield items.pop()


def _build(cfg: DataConfig, base_dir: Path, out: Path, progress: bool) -> Manifest:
    docs = iter_documents(cfg, base_dir)
    if cfg.tokenizer == "bpe":
        # one pass over the corpus: the BPE's training documents are kept and tokenized first
        head = list(itertools.islice(docs, cfg.tokenizer_train_documents))
        if not head:
            raise _empty(cfg, "documents")
        tok = train_bpe(head, cfg.vocab_size)
        vocab_size = cfg.vocab_size  # the trained vocab can be smaller on a tiny corpus; ids stay below this
    else:
        head = []
        tok = load_tokenizer(_tokenizer_path(cfg, base_dir))
        # ids of added tokens may lie past get_vocab_size(): size by the largest id
        vocab_size = max(tok.get_vocab_size(), max(tok.get_vocab(with_added_tokens=True).values()) + 1)
    eot_id = tok.token_to_id(EOT)
    if eot_id is None:
        raise DataError(f"tokenizer {cfg.tokenizer} has no {EOT} token; data.tokenizer must define it")
    sha = tokenizer_sha256(tok)  # before the flag below, which is not serialized anyway
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" inside a document is text, not a separator
    dtype = token_dtype(vocab_size)

    every = max(2, round(1 / cfg.val_fraction))
    writers = {s: _ShardWriter(out, s, dtype, cfg.shard_tokens) for s in SPLITS}
    bar = tqdm(desc=f"tokenizing {cfg.name}", unit="doc", disable=not progress)
    start, total, index = time.perf_counter(), 0, 0
    try:
        for batch in _batches(itertools.chain(_drain(head), docs), _ENCODE_BATCH):
            flat = {s: [] for s in SPLITS}  # one write per split per batch, not per document
            for enc in tok.encode_batch(batch):
                # documents 1, 1+k, 1+2k, ... are validation: deterministic, streaming, and
                # any corpus of >= 2 documents gets one
                split = "val" if index % every == 1 else "train"
                flat[split].extend(enc.ids)
                flat[split].append(eot_id)
                writers[split].documents += 1
                index += 1
            for s in SPLITS:
                writers[s].write(np.asarray(flat[s], dtype=np.int64))
                total += len(flat[s])
            bar.update(len(batch))
            bar.set_postfix_str(f"{total / max(time.perf_counter() - start, 1e-9):.3g} tok/s")
    finally:
        bar.close()
        for w in writers.values():
            w.close()

    for s in SPLITS:
        if not writers[s].documents:
            raise _empty(cfg, f"{s} documents")
    tok.encode_special_tokens = False
    tok.save(str(out / TOKENIZER))
    manifest = Manifest(
        version=VERSION,
        tokenizer_sha256=sha,
        vocab_size=vocab_size,
        eot_id=eot_id,
        dtype=dtype,
        splits={s: writers[s].shards for s in SPLITS},
        documents={s: writers[s].documents for s in SPLITS},
        source=describe_source(cfg),
    )
    # last: its presence marks the directory complete
    (out / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1))
    return manifest


def _empty(cfg: DataConfig, what: str) -> DataError:
    hint = {
        "stdlib": "data.roots / data.include_stdlib",
        "files": "data.paths / data.text_field",
        "hub": "data.hub_path / data.hub_name / data.split",
    }[source_of(cfg).value]
    return DataError(
        f"the corpus ({describe_source(cfg)}) gave no {what}: check {hint}, "
        "and raise data.max_documents (at least 2 documents are needed: one for train, one for val)")
