"""Corpus readers: turn a DataConfig into a deterministic stream of document texts."""
import glob
import itertools
import os
import site
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, List

from .config import DataConfig, Source
from .errors import DataError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# file extension -> `datasets` packaged builder
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def source_of(cfg: DataConfig) -> Source:
    try:
        return Source(cfg.source)
    except ValueError:
        valid = ", ".join(s.value for s in Source)
        raise DataError(f"data.source={cfg.source!r} is not one of: {valid}") from None


def describe_source(cfg: DataConfig) -> str:
    """Human-readable account of what is read; stored in the manifest to detect a changed corpus."""
    src = source_of(cfg)
    if src is Source.stdlib:
        # include_site_packages named only when on: caches prepared before it existed stay valid
        # the directories themselves too: another machine's packages are another corpus
        site_dirs = f"site_packages={site_packages()}, " if cfg.include_site_packages else ""
        what = f"stdlib(include_stdlib={cfg.include_stdlib}, {site_dirs}roots={list(cfg.roots)})"
    elif src is Source.files:
        what = f"files(paths={list(cfg.paths)}, text_field={cfg.text_field!r})"
    else:
        what = f"hub({cfg.hub_path!r}, name={cfg.hub_name!r}, split={cfg.split!r}, text_field={cfg.text_field!r})"
    split = f", val_fraction={cfg.val_fraction}"  # the train/val split is part of what the shards hold
    if cfg.tokenizer == "bpe":
        split += f", tokenizer_train_documents={cfg.tokenizer_train_documents}"
    return f"{what}, max_documents={cfg.max_documents}{split}"


def iter_documents(cfg: DataConfig, base_dir: Path) -> Iterator[str]:
    """Yield the corpus' documents (non-empty strings) in a deterministic order."""
    base_dir = Path(base_dir)
    src = source_of(cfg)
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise DataError(f"data.max_documents={cfg.max_documents} must be >= 1 or null")
    # file lists and datasets are resolved here, so setting errors surface before any reading
    if src is Source.stdlib:
        docs = _read_files(list_python_files(cfg, base_dir))
    elif src is Source.files:
        docs = _file_documents(cfg, resolve_paths(cfg, base_dir))
    else:
        docs = texts_of(_load_hub(cfg, base_dir), cfg.text_field, f"data.hub_path={cfg.hub_path!r}")
    return itertools.islice(docs, cfg.max_documents)


# --- stdlib -----------------------------------------------------------------

def list_python_files(cfg: DataConfig, base_dir: Path) -> List[Path]:
    """The .py files of the stdlib (if enabled) and of cfg.roots, sorted, without duplicates."""
    roots = []
    if cfg.include_stdlib:
        roots.append(Path(sysconfig.get_paths()["stdlib"]))
    if cfg.include_site_packages:
        roots += [Path(p) for p in site_packages()]
    for r in cfg.roots:
        p = Path(r) if Path(r).is_absolute() else Path(base_dir) / r
        if not p.exists():
            raise DataError(f"data.roots entry {r!r} does not exist (looked at {p})")
        roots.append(p)
    files, seen = [], set()
    for root in roots:
        for f in _walk_py(root):
            key = f.resolve()
            if key not in seen:  # a root inside the stdlib must not double its files
                seen.add(key)
                files.append(f)
    return files


def site_packages() -> List[str]:
    """Every global site directory that exists (Debian has several), not just sysconfig's purelib."""
    return [p for p in site.getsitepackages() if Path(p).is_dir()]


def _walk_py(root: Path) -> Iterator[Path]:
    if root.is_file():
        if root.suffix == ".py":
            yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        # prune in place: third-party packages are not the stdlib, caches are not source
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _read_files(files: List[Path]) -> Iterator[str]:
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"cannot read source file {f}: {e}") from e
        if text:
            yield text


# --- files / hub (through `datasets`) ----------------------------------------

def resolve_paths(cfg: DataConfig, base_dir: Path) -> List[Path]:
    """Expand cfg.paths (globs allowed, relative to base_dir) into files, in a stable order."""
    if not cfg.paths:
        raise DataError("data.paths is empty: list .txt, .jsonl/.json or .parquet files (globs allowed) for data.source=files")
    out, seen = [], set()
    for pattern in cfg.paths:
        full = pattern if os.path.isabs(pattern) else str(Path(base_dir) / pattern)
        matches = sorted(glob.glob(full, recursive=True)) if glob.has_magic(full) else [full]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise DataError(f"data.paths entry {pattern!r} matched no file (looked for {full})")
        for m in matches:
            p = Path(m)
            if p.suffix.lower() not in BUILDERS:
                valid = ", ".join(BUILDERS)
                raise DataError(f"data.paths file {p} has an unknown extension; valid: {valid}")
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def _file_documents(cfg: DataConfig, files: List[Path]) -> Iterator[str]:
    import datasets  # slow to import: only when needed

    # one load_dataset per run of same-format files keeps the listed order
    for builder, group in itertools.groupby(files, key=lambda p: BUILDERS[p.suffix.lower()]):
        group = [str(p) for p in group]
        what = group[0] if len(group) == 1 else f"{group[0]} (+{len(group) - 1} more)"
        kwargs = {"sample_by": "document"} if builder == "text" else {}  # one .txt file = one document
        try:
            ds = datasets.load_dataset(builder, data_files=group, split="train", streaming=True, **kwargs)
        except Exception as e:
            raise DataError(f"cannot read data.paths file {what}: {e}") from e
        yield from texts_of(ds, cfg.text_field, what)


def _load_hub(cfg: DataConfig, base_dir: Path):
    if not cfg.hub_path:
        raise DataError("data.hub_path is empty: name a dataset, e.g. HuggingFaceFW/fineweb-edu")
    import datasets

    path = cfg.hub_path
    local = Path(base_dir) / path
    if not os.path.isabs(path) and local.is_dir():  # a local dataset folder relative to the repo
        path = str(local)
    try:
        ds = datasets.load_dataset(path, cfg.hub_name, split=cfg.split, streaming=True)
    except Exception as e:
        raise DataError(
            f"cannot load data.hub_path={cfg.hub_path!r} (name={cfg.hub_name!r}, split={cfg.split!r}): {e}; "
            "the hub may be unreachable: local files work through data.source=files"
        ) from e
    return ds


def texts_of(ds: Iterable[dict], text_field: str, what: str) -> Iterator[str]:
    """Texts of an (iterable) dataset's `text_field`, skipping empty ones; `what` names it in errors."""
    it = iter(ds)
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:  # parse errors and dropped connections surface while streaming
            raise DataError(f"error while reading {what}: {e}") from e
        if text_field not in row:
            raise DataError(f"data.text_field={text_field!r} is not a column of {what}; columns found: {sorted(row)}")
        text = row[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(f"data.text_field={text_field!r} of {what} holds {type(text).__name__}, not text")
        if text:
            yield text
