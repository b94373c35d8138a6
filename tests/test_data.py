"""Tests of the data pipeline on small synthetic corpora (no network)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import data.shards as shards_mod
from data.config import DataConfig
from data.errors import DataError
from data.loader import TokenLoader
from data.shards import Manifest, load_manifest, prepare, shard_dir_for, token_dtype
from data.sources import iter_documents, list_python_files
from data.tokenizer import EOT, load_tokenizer, tokenizer_sha256, train_bpe

DOCS = [
    f"def f{i}(x):\n    # naïve ✓ {i}\n\treturn x * {i} + {'y' * i}\n" for i in range(10)
] + [
    "plain text with a literal <|endoftext|> inside, which must stay text\n",
    "emoji 🚀 and CJK 漢字 and trailing spaces   ",
]


def _write_py_corpus(root: Path, docs=DOCS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / f"doc_{i:03d}.py").write_text(d, encoding="utf-8")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "skip.py").write_text("skipped = True\n")
    (root / "empty.py").write_text("")  # empty files are skipped
    return root


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    base = dict(include_stdlib=False, roots=["corpus"], cache_dir="cache", vocab_size=300,
                val_fraction=0.25, tokenizer_train_documents=1000)
    base.update(kw)
    return DataConfig(**base)


def _split_docs(shard_dir: Path, m: Manifest, split: str):
    """Decode a split's shards back into documents by cutting at EOT."""
    tok = load_tokenizer(shard_dir / "tokenizer.json")
    ids = np.concatenate([np.fromfile(shard_dir / s["file"], dtype=m.dtype) for s in m.splits[split]])
    assert ids[-1] == m.eot_id
    cuts = np.flatnonzero(ids == m.eot_id)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, cuts)]


# --- shards -------------------------------------------------------------------

def test_round_trip_multi_shard(tmp_path):
    _write_py_corpus(tmp_path / "corpus")
    cfg = _cfg(tmp_path, shard_tokens=50)  # tiny shards: documents span shard files
    shard_dir, m = prepare(cfg, tmp_path, progress=False)
    assert shard_dir == tmp_path / "cache" / "stdlib-bpe300"
    assert (shard_dir / "manifest.json").is_file() and (shard_dir / "tokenizer.json").is_file()
    k = round(1 / cfg.val_fraction)
    want_val = [d for i, d in enumerate(DOCS) if i % k == 1]
    want_train = [d for i, d in enumerate(DOCS) if i % k != 1]
    assert _split_docs(shard_dir, m, "train") == want_train
    assert _split_docs(shard_dir, m, "val") == want_val
    assert m.documents == {"train": len(want_train), "val": len(want_val)}
    assert len(m.splits["train"]) > 1
    for split in ("train", "val"):
        for s in m.splits[split]:
            assert 0 < s["tokens"] <= 50
            assert (shard_dir / s["file"]).stat().st_size == s["tokens"] * np.dtype(m.dtype).itemsize
    assert m.dtype == "uint16" and m.vocab_size == 300 and m.eot_id == 0
    assert m.tokenizer_sha256 == tokenizer_sha256(load_tokenizer(shard_dir / "tokenizer.json"))
    assert load_manifest(shard_dir) == m
    # nothing but the finished directory is left behind
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["stdlib-bpe300"]


def test_max_documents_caps_the_corpus(tmp_path):
    _write_py_corpus(tmp_path / "corpus")
    cfg = _cfg(tmp_path, max_documents=5)
    assert list(iter_documents(cfg, tmp_path)) == DOCS[:5]
    _, m = prepare(cfg, tmp_path, progress=False)
    assert m.documents["train"] + m.documents["val"] == 5


def test_dtype_choice():
    assert token_dtype(300) == "uint16"
    assert token_dtype(65536) == "uint16"  # ids 0..65535 fit
    assert token_dtype(65537) == "uint32"
    assert token_dtype(200_000) == "uint32"


def test_cache_is_reused_without_reading(tmp_path, monkeypatch):
    _write_py_corpus(tmp_path / "corpus")
    cfg = _cfg(tmp_path)
    shard_dir, m = prepare(cfg, tmp_path, progress=False)

    def boom(*a, **k):
        raise AssertionError("corpus was read again")

    monkeypatch.setattr(shards_mod, "iter_documents", boom)
    shard_dir2, m2 = prepare(cfg, tmp_path, progress=False)
    assert (shard_dir2, m2) == (shard_dir, m)
    # a different corpus description or vocab on the same directory is refused, not silently reused
    with pytest.raises(DataError, match="max_documents"):
        prepare(_cfg(tmp_path, max_documents=3, shard_dir=str(shard_dir)), tmp_path, progress=False)
    with pytest.raises(DataError, match="data.vocab_size=400"):
        prepare(_cfg(tmp_path, vocab_size=400, shard_dir=str(shard_dir)), tmp_path, progress=False)


def test_truncated_and_missing_shard(tmp_path):
    _write_py_corpus(tmp_path / "corpus")
    shard_dir, m = prepare(_cfg(tmp_path, shard_tokens=50), tmp_path, progress=False)
    f = shard_dir / m.splits["train"][1]["file"]
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 2)
    with pytest.raises(DataError, match=rf"{f.name} is truncated: \d+ bytes, manifest says \d+"):
        load_manifest(shard_dir)
    with pytest.raises(DataError, match="truncated"):  # prepare verifies the cache too
        prepare(_cfg(tmp_path, shard_tokens=50), tmp_path, progress=False)
    f.unlink()
    with pytest.raises(DataError, match=rf"{f.name} is missing"):
        load_manifest(shard_dir)


def test_empty_corpus_errors_and_leaves_nothing(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "empty.py").write_text("")
    with pytest.raises(DataError, match="data.roots"):
        prepare(_cfg(tmp_path), tmp_path, progress=False)
    # one document: nothing for validation
    _write_py_corpus(tmp_path / "one", docs=["x = 1\n"])
    with pytest.raises(DataError, match="val documents"):
        prepare(_cfg(tmp_path, roots=["one"]), tmp_path, progress=False)
    assert list((tmp_path / "cache").iterdir()) == []  # no half directory, no temp directory


def test_bad_settings(tmp_path):
    with pytest.raises(DataError, match="data.roots.*nope"):
        list(iter_documents(_cfg(tmp_path, roots=["nope"]), tmp_path))
    _write_py_corpus(tmp_path / "corpus")
    with pytest.raises(DataError, match="data.val_fraction"):
        prepare(_cfg(tmp_path, val_fraction=0.0), tmp_path, progress=False)
    with pytest.raises(DataError, match="data.vocab_size"):
        prepare(_cfg(tmp_path, vocab_size=100), tmp_path, progress=False)
    with pytest.raises(DataError, match="data.source"):
        iter_documents(_cfg(tmp_path, source="ftp"), tmp_path)


# --- tokenizer ------------------------------------------------------------------

def test_tokenizer_from_path(tmp_path):
    _write_py_corpus(tmp_path / "corpus")
    tok = train_bpe(DOCS, 320)
    tok.save(str(tmp_path / "mytok.json"))
    sha = tokenizer_sha256(tok)
    cfg = _cfg(tmp_path, tokenizer="mytok.json", name="py")
    shard_dir, m = prepare(cfg, tmp_path, progress=False)
    assert shard_dir == tmp_path / "cache" / f"py-mytok-{sha[:8]}" == shard_dir_for(cfg, tmp_path)
    assert m.tokenizer_sha256 == sha and m.vocab_size == tok.get_vocab_size() == 320
    assert m.eot_id == tok.token_to_id(EOT)
    assert tokenizer_sha256(load_tokenizer(shard_dir / "tokenizer.json")) == sha
    assert _split_docs(shard_dir, m, "train") + _split_docs(shard_dir, m, "val") != []
    assert sorted(_split_docs(shard_dir, m, "train") + _split_docs(shard_dir, m, "val")) == sorted(DOCS)
    # shards made with this tokenizer, now configured with another one
    train_bpe(DOCS[:3], 280).save(str(tmp_path / "other.json"))
    other = tokenizer_sha256(load_tokenizer(tmp_path / "other.json"))
    with pytest.raises(DataError, match=rf"{sha[:8]}.*data.tokenizer=other.json.*{other[:8]}"):
        prepare(_cfg(tmp_path, tokenizer="other.json", shard_dir=str(shard_dir)), tmp_path, progress=False)


def test_tokenizer_hash_and_missing_file(tmp_path):
    assert tokenizer_sha256(train_bpe(DOCS, 300)) == tokenizer_sha256(train_bpe(DOCS, 300))
    assert tokenizer_sha256(train_bpe(DOCS, 300)) != tokenizer_sha256(train_bpe(DOCS, 290))
    with pytest.raises(DataError, match="nothere.json"):
        load_tokenizer(tmp_path / "nothere.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_tokenizer(tmp_path / "bad.json")


# --- sources --------------------------------------------------------------------

def _jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_files_txt_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "in"
    d.mkdir()
    (d / "b.txt").write_text("second file\n\nwith a blank line\n", encoding="utf-8")
    (d / "a.txt").write_text("first file ✓\n", encoding="utf-8")
    _jsonl(d / "x.jsonl", [{"text": "json one", "id": 1}, {"text": "json two", "id": 2}, {"text": ""}])
    pq.write_table(pa.table({"body": ["pq one", "pq two"], "n": [1, 2]}), d / "p.parquet")

    def docs(**kw):
        return list(iter_documents(DataConfig(source="files", **kw), tmp_path))

    assert docs(paths=["in/*.txt"]) == ["first file ✓\n", "second file\n\nwith a blank line\n"]
    assert docs(paths=[str(d / "x.jsonl")]) == ["json one", "json two"]  # absolute path; empty text skipped
    assert docs(paths=["in/p.parquet"], text_field="body") == ["pq one", "pq two"]
    assert docs(paths=["in/x.jsonl", "in/a.txt"]) == ["json one", "json two", "first file ✓\n"]  # listed order
    assert docs(paths=["in/*.txt"], max_documents=1) == ["first file ✓\n"]
    # the full pipeline on files
    shard_dir, m = prepare(DataConfig(source="files", paths=["in/*.txt", "in/x.jsonl"], name="f", vocab_size=300,
                                      val_fraction=0.5, cache_dir="cache"), tmp_path, progress=False)
    assert _split_docs(shard_dir, m, "train") == ["first file ✓\n", "json one"]
    assert _split_docs(shard_dir, m, "val") == ["second file\n\nwith a blank line\n", "json two"]


def test_files_errors(tmp_path):
    _jsonl(tmp_path / "x.jsonl", [{"content": "a"}])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data.text_field='text'.*\['content'\]"):
        list(iter_documents(DataConfig(source="files", paths=["x.jsonl"]), tmp_path))
    with pytest.raises(DataError, match=r"data.paths.*nothing/\*.jsonl"):
        iter_documents(DataConfig(source="files", paths=["nothing/*.jsonl"]), tmp_path)
    with pytest.raises(DataError, match=r"data.paths.*x.csv.*\.parquet"):
        iter_documents(DataConfig(source="files", paths=["*.csv"]), tmp_path)
    with pytest.raises(DataError, match="data.paths is empty"):
        iter_documents(DataConfig(source="files"), tmp_path)


def test_hub_path_through_local_folder(tmp_path):
    _jsonl(tmp_path / "ds" / "part-0.jsonl", [{"text": "hub a"}, {"text": "hub b"}])
    _jsonl(tmp_path / "ds" / "part-1.jsonl", [{"text": "hub c"}])
    cfg = DataConfig(source="hub", hub_path=str(tmp_path / "ds"), split="train")
    assert sorted(iter_documents(cfg, tmp_path)) == ["hub a", "hub b", "hub c"]
    relative = DataConfig(source="hub", hub_path="ds")  # a local folder relative to base_dir
    assert sorted(iter_documents(relative, tmp_path)) == ["hub a", "hub b", "hub c"]
    cfg.max_documents = 2
    assert len(list(iter_documents(cfg, tmp_path))) == 2
    cfg.text_field = "body"
    with pytest.raises(DataError, match=r"data.text_field='body'.*\['text'\]"):
        list(iter_documents(cfg, tmp_path))
    with pytest.raises(DataError, match="data.hub_path.*unreachable.*data.source=files"):
        iter_documents(DataConfig(source="hub", hub_path=str(tmp_path / "absent")), tmp_path)


def test_stdlib_listing():
    cfg = DataConfig(include_stdlib=True)
    files = list_python_files(cfg, Path("."))
    assert len(files) > 1000
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "dist-packages", "__pycache__"} & set(f.parts) for f in files)
    assert list_python_files(cfg, Path(".")) == files  # deterministic


def test_site_packages_listing():
    """include_site_packages reads the installed packages' sources too (the GPU study's corpus)."""
    cfg = DataConfig(include_stdlib=False, include_site_packages=True)
    files = list_python_files(cfg, Path("."))
    import hydra  # installed in every environment that runs the tests
    assert Path(hydra.__file__) in files
    both = list_python_files(DataConfig(include_stdlib=True, include_site_packages=True), Path("."))
    assert len(both) == len(set(both)) > len(files)


def test_roots_skip_caches_and_empty_files(tmp_path):
    _write_py_corpus(tmp_path / "corpus")
    names = [f.name for f in list_python_files(_cfg(tmp_path), tmp_path)]
    assert "skip.py" not in names and names[:2] == ["doc_000.py", "doc_001.py"]
    # a root listed twice, or nested in another, does not duplicate files
    assert list_python_files(_cfg(tmp_path, roots=["corpus", str(tmp_path / "corpus")]), tmp_path) == \
        list_python_files(_cfg(tmp_path), tmp_path)
    assert list(iter_documents(_cfg(tmp_path), tmp_path)) == DOCS


# --- loader ---------------------------------------------------------------------

N_TOKENS, SEQ = 1001, 10  # 100 windows; token t has value t, so x[:, 0] // SEQ is the window


def _arange_shards(tmp_path: Path, sizes=(333, 7, 400, 261)) -> Manifest:
    assert sum(sizes) == N_TOKENS
    tokens, pos, entries = np.arange(N_TOKENS, dtype=np.uint16), 0, []
    for k, n in enumerate(sizes):
        tokens[pos:pos + n].tofile(tmp_path / f"train_{k:06d}.bin")
        entries.append({"file": f"train_{k:06d}.bin", "tokens": n})
        pos += n
    tokens[:50].tofile(tmp_path / "val_000000.bin")
    return Manifest(version=1, tokenizer_sha256="0" * 64, vocab_size=4096, eot_id=0, dtype="uint16",
                    splits={"train": entries, "val": [{"file": "val_000000.bin", "tokens": 50}]},
                    documents={"train": 1, "val": 1}, source="synthetic")


def _loader(tmp_path, m, **kw):
    args = dict(split="train", seq_len=SEQ, batch_size=4, seed=0)
    args.update(kw)
    return TokenLoader(tmp_path, m, **args)


def _windows(x: torch.Tensor):
    return (x[:, 0] // SEQ).tolist()


def test_loader_windows_and_shift(tmp_path):
    m = _arange_shards(tmp_path)
    ld = _loader(tmp_path, m)
    assert ld.n_windows == 100
    for _ in range(30):
        x, y = ld.next_batch()
        assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
        assert torch.equal(x[:, 1:], y[:, :-1])
        # whole non-overlapping windows, stitched correctly across shard boundaries
        start = x[:, :1]
        assert torch.equal(x, start + torch.arange(SEQ)) and torch.equal(y, start + 1 + torch.arange(SEQ))
        assert (start % SEQ == 0).all()


def test_loader_deterministic_by_seed(tmp_path):
    m = _arange_shards(tmp_path)
    a, b, c = _loader(tmp_path, m), _loader(tmp_path, m), _loader(tmp_path, m, seed=1)
    ba = [a.next_batch() for _ in range(5)]
    bb = [b.next_batch() for _ in range(5)]
    bc = [c.next_batch() for _ in range(5)]
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(ba, bb))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(ba, bc))


def test_loader_resume_is_exact(tmp_path):
    m = _arange_shards(tmp_path)
    ref = _loader(tmp_path, m)
    ref_batches = [ref.next_batch()[0] for _ in range(40)]  # 160 samples: crosses an epoch
    run = _loader(tmp_path, m)
    for _ in range(17):
        run.next_batch()
    state = run.state_dict()
    assert state == {"samples_seen": 68, "seed": 0, "seq_len": SEQ, "split": "train"}
    resumed = _loader(tmp_path, m)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint round trip
    for k in range(17, 40):
        assert torch.equal(resumed.next_batch()[0], ref_batches[k])


def test_loader_ranks_are_disjoint_and_cover_the_global_batch(tmp_path):
    m = _arange_shards(tmp_path)
    world1 = _loader(tmp_path, m, batch_size=8)
    r0 = _loader(tmp_path, m, rank=0, world_size=2)
    r1 = _loader(tmp_path, m, rank=1, world_size=2)
    for _ in range(20):  # 160 samples: crosses an epoch
        g = _windows(world1.next_batch()[0])
        w0, w1 = _windows(r0.next_batch()[0]), _windows(r1.next_batch()[0])
        assert not set(w0) & set(w1)
        assert w0 + w1 == g


def test_loader_epochs(tmp_path):
    m = _arange_shards(tmp_path)
    ld = _loader(tmp_path, m, batch_size=10)
    e0 = sum((_windows(ld.next_batch()[0]) for _ in range(10)), [])
    e1 = sum((_windows(ld.next_batch()[0]) for _ in range(10)), [])
    assert sorted(e0) == sorted(e1) == list(range(100))  # each window exactly once per epoch
    assert e0 != e1  # a new permutation each epoch
    assert e0 != list(range(100))  # shuffled
    # a batch straddling the epoch boundary takes the tail of one and the head of the next
    odd = _loader(tmp_path, m, batch_size=7)
    flat = sum((_windows(odd.next_batch()[0]) for _ in range(30)), [])
    assert flat[:100] == e0 and flat[100:200] == e1


def test_loader_state_mismatch(tmp_path):
    m = _arange_shards(tmp_path)
    ld = _loader(tmp_path, m)
    good = ld.state_dict()
    for key, val in (("seed", 7), ("seq_len", 11), ("split", "val")):
        with pytest.raises(DataError, match=rf"{key}={val!r}.*{key}={good[key]!r}"):
            ld.load_state_dict({**good, key: val})


def test_loader_fixed_batches_and_too_short(tmp_path):
    m = _arange_shards(tmp_path)
    ld = _loader(tmp_path, m, split="val", batch_size=2)  # 50 tokens: 4 windows
    first = ld.fixed_batches(1)
    assert len(first) == 1 and _windows(first[0][0]) == [0, 1]
    again = ld.fixed_batches(1)
    assert torch.equal(first[0][0], again[0][0]) and torch.equal(first[0][1], again[0][1])
    ld.next_batch()  # training draws do not move validation windows
    many = ld.fixed_batches(10)  # the split is small: fewer batches
    assert [_windows(x) for x, _ in many] == [[0, 1], [2, 3]]
    assert torch.equal(many[0][1], first[0][1])
    with pytest.raises(DataError, match=r"trainer.seq_len=50.*50 tokens.*data.val_fraction"):
        _loader(tmp_path, m, split="val", seq_len=50)


def test_changed_split_settings_are_not_served_from_cache(tmp_path):
    """A cached shard dir made with another val_fraction is refused, not silently reused."""
    from data.config import DataConfig
    from data.errors import DataError
    from data.shards import prepare

    root = tmp_path / "src"
    root.mkdir()
    for i in range(12):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20)
    cfg = DataConfig(include_stdlib=False, roots=[str(root)], vocab_size=300, cache_dir=str(tmp_path / "c"),
                     val_fraction=0.25)
    prepare(cfg, tmp_path, progress=False)
    cfg.val_fraction = 0.5
    with pytest.raises(DataError, match="val_fraction=0.25"):
        prepare(cfg, tmp_path, progress=False)


def test_batch_to_device_keeps_the_batch(tmp_path):
    """The loader's batch on the CPU "device": the same values, dtype and shape (the trainer's and
    bench_step's path on machines without a GPU)."""
    from data.loader import batch_to_device

    ld = _loader(tmp_path, _arange_shards(tmp_path))
    x, y = ld.next_batch()
    dx, dy = batch_to_device(x, y, torch.device("cpu"))
    assert torch.equal(dx, x) and torch.equal(dy, y) and dx.dtype == torch.int64


@pytest.mark.gpu
def test_batch_to_device_does_not_wait_for_the_gpu_and_every_batch_arrives_intact():
    """On a GPU busy with earlier work the copy returns at once (through page-locked memory; a
    pageable copy may wait for the stream), and batches issued back to back while the GPU is busy
    arrive intact: no page-locked block is reused before the copy from it has run."""
    from data.loader import batch_to_device

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream()
    x = torch.zeros(8, 2048, dtype=torch.int64)
    torch.cuda._sleep(200_000_000)  # a first round while busy: the caching host allocator's blocks exist
    for _ in range(64):             # when the checked round asks for them, as after a run's first steps
        batch_to_device(x, x, dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the copies
    sent, got = [], []
    for i in range(64):
        x = torch.full((8, 2048), i, dtype=torch.int64)
        y = torch.arange(8 * 2048, dtype=torch.int64).view(8, 2048) + i
        sent.append((x.clone(), y.clone()))
        got.append(batch_to_device(x, y, dev))
        x.fill_(-1)  # the caller's tensors reused at once, as a loader's may be
        y.fill_(-1)
    assert not stream.query(), "the host waited for the GPU's queued work"
    torch.cuda.synchronize()
    for (x, y), (dx, dy) in zip(sent, got):
        assert dx.is_cuda and torch.equal(dx.cpu(), x) and torch.equal(dy.cpu(), y)
