"""training/checkpoint.py in one process, without training: the asynchronous save (training goes
on while it writes; invisible to resume until complete; one in flight), its disk-full case,
checksums old and new, pruning that a SIGKILL cannot turn into an orphan, and the size estimate
and free-space check made before training."""
import errno
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import training.checkpoint as ck
from helpers import BASE_ENV, ROOT, background
from model import Transformer
from model.config import FFNConfig, ModelConfig
from training.errors import CheckpointError

TINY = dict(dim=64, n_layers=2, n_heads=2, swiglu_hidden=128, max_seq_len=64)  # tests/helpers.py's tiny run


def trained(model_kw=TINY, vocab=512, steps=1):
    """A model and AdamW after `steps` steps (so the optimizer has its state)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**model_kw), FFNConfig(), vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 16))
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state_of(model, opt, **extra) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optimizer": o, "rank": {"rng": ck.rng_state(), "loader": {"samples_seen": 3}},
            "config": {"trainer": {"seed": 1}}, **extra}


def names(run: Path) -> list[str]:
    d = ck.checkpoint_dir(run)
    return sorted(os.listdir(d)) if d.is_dir() else []


@pytest.fixture
def gate(monkeypatch):
    """DCP's file writer waits on this event for checkpoints of step >= 2: a write held in flight."""
    release, entered = threading.Event(), threading.Event()
    real = dcp_fs._write_item

    def write_item(transforms, stream, *a, **k):
        if "step_00000001" not in str(getattr(stream, "name", "")):
            entered.set()
            assert release.wait(60)
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    yield release, entered
    release.set()


def test_async_save_snapshots_the_state_and_training_goes_on(tmp_path):
    """save() returns before the write; the weights changed right after are not in the checkpoint,
    which equals a synchronous save of the same state."""
    model, opt = trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    c = ck.Checkpointer(tmp_path / "async", keep_last=0, asynchronous=True)
    c.save(1, state_of(model, opt))
    with torch.no_grad():  # "the next training step", while the write is under way
        for p in model.parameters():
            p.add_(1.0)
    c.close()
    got = ck.load_checkpoint(tmp_path / "async" / "checkpoints" / "step_00000001")["model"]
    sync = ck.load_checkpoint(ck.save_checkpoint(tmp_path / "sync", 1, state_of(model, opt)))["model"]
    for k, v in before.items():
        assert torch.equal(got[k], v), k
        assert torch.equal(sync[k], v + 1), k  # the same path, synchronously, after the change
    manifest = json.loads((tmp_path / "async" / "checkpoints" / "step_00000001" / "manifest.json").read_text())
    assert manifest["hash"] == "xxh3_128"
    assert [s["step"] for s in c.saves] == [1] and c.saves[0]["bytes"] > 0


def test_async_checkpoint_is_invisible_until_complete_and_the_next_save_waits(tmp_path, gate, caplog):
    caplog.set_level(logging.INFO, logger="training.checkpoint")
    release, entered = gate
    model, opt = trained()
    run = tmp_path / "run"
    c = ck.Checkpointer(run, keep_last=0, asynchronous=True)
    c.save(1, state_of(model, opt))
    c.wait()
    t0 = time.perf_counter()
    c.save(2, state_of(model, opt))  # held in DCP's writer by the gate
    assert time.perf_counter() - t0 < 30 and entered.wait(30)
    assert names(run) == [".step_00000002.tmp", "step_00000001"]
    assert ck.list_checkpoints(run) == [run / "checkpoints" / "step_00000001"]
    second = threading.Thread(target=c.save, args=(3, state_of(model, opt)))
    second.start()
    time.sleep(0.5)
    assert second.is_alive()  # waits for step 2
    assert ".step_00000003.tmp" not in names(run)
    release.set()
    second.join(60)
    c.close()
    assert names(run) == ["step_00000001", "step_00000002", "step_00000003"]
    for p in ck.list_checkpoints(run):
        ck.verify_checkpoint(p)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint step 3:")]
    assert len(lines) == 1 and " stall " in lines[0] and " written in " in lines[0] and " GB " in lines[0]


KILL_MID_ASYNC_WRITE = r"""
import os, signal, sys, threading, torch
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import torch.distributed.checkpoint.filesystem as dcp_fs
import training.checkpoint as ck
run = Path(sys.argv[1])
real = dcp_fs._write_item
def write_item(transforms, stream, *a, **k):  # step 2: some bytes out, then the process dies
    if "step_00000002" in str(stream.name):
        stream.write(b"part of a shard")
        stream.flush()
        returned.wait(30)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(transforms, stream, *a, **k)
dcp_fs._write_item = write_item
returned = threading.Event()
c = ck.Checkpointer(run, keep_last=0, asynchronous=True)
for step in (1, 2):
    c.save(step, {"model": {"w": torch.ones(1000) * step}, "rank": {"x": step}})
    print("saved", step, flush=True)  # save() returned: the loop would train on
    returned.set() if step == 2 else None
c.close()
"""


@background
def launches(ctx):
    """The two processes killed mid-write (helpers.background): (result, run directory) each."""
    def killed(script: str, name: str):
        run = ctx.tmp(name) / "run"
        return lambda: (subprocess.run([sys.executable, "-c", script, str(run), str(ROOT)], capture_output=True,
                                       text=True, env=BASE_ENV, timeout=120), run)

    return {"test_sigkill_during_an_async_write_leaves_nothing_resume_would_pick": killed(KILL_MID_ASYNC_WRITE, "async"),
            "test_sigkill_while_pruning_leaves_no_step_directory_without_manifest": killed(KILL_MID_PRUNE, "prune")}


def test_sigkill_during_an_async_write_leaves_nothing_resume_would_pick(launched):
    p, run = launched["test_sigkill_during_an_async_write_leaves_nothing_resume_would_pick"].result()
    assert p.returncode == -9, p.stderr[-2000:]
    assert "saved 2" in p.stdout  # killed in the background write, after save() had returned
    assert names(run) == [".step_00000002.tmp", "step_00000001"]
    path, state = ck.find_resume_checkpoint("auto", run)
    assert path.name == "step_00000001" and state["step"] == 1
    assert names(run) == ["step_00000001"]  # the partial write is removed on resume


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_disk_full_names_the_reason_and_path_and_keeps_older_checkpoints(tmp_path, monkeypatch, asynchronous):
    real = dcp_fs._write_item

    def write_item(transforms, stream, *a, **k):
        if "step_00000002" in str(getattr(stream, "name", "")):
            stream.write(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    model, opt = trained()
    run = tmp_path / "run"
    c = ck.Checkpointer(run, keep_last=1, asynchronous=asynchronous)
    c.save(1, state_of(model, opt))
    with pytest.raises(CheckpointError) as e:
        c.save(2, state_of(model, opt))
        c.close()  # async: the write's error comes at the next save or at close
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and str(run / "checkpoints" / "step_00000002") in msg
    assert msg.startswith(f"disk full (No space left on device) while writing checkpoint {run / 'checkpoints'}")
    assert re.search(r": [\d,.]+ (bytes|GB|TB) free on /\S*; the previous checkpoints in \S+ are intact$", msg), msg
    assert names(run) == ["step_00000001"]
    ck.verify_checkpoint(run / "checkpoints" / "step_00000001")


TORCH_WRITE_FAILED = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.parametrize("context, free, full", [(True, 10 << 30, True), (False, 4096, True), (False, 10 << 30, False)],
                         ids=["enospc-inside", "little-left", "room-left"])
def test_torchs_failed_write_is_named_disk_full_with_the_bytes_free(tmp_path, monkeypatch, context, free, full):
    """torch's zip writer reports a refused write as "unexpected pos": with the OS's ENOSPC inside it,
    or with little left on the filesystem, that is a full disk; otherwise its own words."""
    real = dcp_fs._write_item

    def write_item(transforms, stream, *a, **k):
        if "step_00000002" in str(getattr(stream, "name", "")):
            stream.write(b"half a shard")
            if context:
                try:
                    raise OSError(errno.ENOSPC, "No space left on device")
                except OSError:
                    raise RuntimeError(TORCH_WRITE_FAILED)
            raise RuntimeError(TORCH_WRITE_FAILED)
        return real(transforms, stream, *a, **k)

    model, opt = trained()
    run = tmp_path / "run"
    ck.save_checkpoint(run, 1, state_of(model, opt))
    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: type("U", (), {"free": free})())
    with pytest.raises(CheckpointError) as e:
        ck.save_checkpoint(run, 2, state_of(model, opt))
    msg, where = str(e.value), run / "checkpoints" / "step_00000002"
    if full:
        assert msg.startswith("disk full") and f"while writing checkpoint {where}: " in msg, msg
        assert f"{free:,} bytes free on " in msg or f"{free / 1e9:.3g} GB free on " in msg, msg
        assert "unexpected pos" not in msg
    else:
        assert msg.startswith(f"could not write checkpoint {where}: {TORCH_WRITE_FAILED}"), msg
    assert msg.endswith("are intact") and "\n" not in msg
    assert names(run) == ["step_00000001"]  # the partial write removed, the previous checkpoint kept
    ck.verify_checkpoint(run / "checkpoints" / "step_00000001")


def test_manifests_of_sha256_still_verify(tmp_path):
    """Manifests written before xxh3_128 name no hash: their sha256 digests are checked."""
    import hashlib

    path = ck.save_checkpoint(tmp_path, 1, {"model": {"w": torch.arange(10.0)}, "rank": {"x": 1}})
    m = json.loads((path / "manifest.json").read_text())
    del m["hash"]
    m["files"] = {n: [size, hashlib.sha256((path / n).read_bytes()).hexdigest()] for n, (size, _) in m["files"].items()}
    (path / "manifest.json").write_text(json.dumps(m))
    ck.verify_checkpoint(path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"the sha256 checksum of {shard.name} does not match"):
        ck.verify_checkpoint(path)


# ---------------------------------------------------------------- pruning under SIGKILL

KILL_MID_PRUNE = r"""
import os, shutil, signal, sys, torch
sys.path.insert(0, sys.argv[2])
import training.checkpoint as ck
run = sys.argv[1]
from pathlib import Path
run = Path(run)
for step in (1, 2):
    ck.save_checkpoint(run, step, {"model": {"w": torch.ones(1000) * step}, "rank": {"x": step}})
real = shutil.rmtree
def rmtree(path, *a, **k):  # delete one file of the checkpoint being pruned, then die
    if "00000001" in str(path) and Path(path).is_dir():
        os.remove(next(p for p in Path(path).iterdir() if p.name.endswith(".distcp")))
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *a, **k)
ck.shutil.rmtree = rmtree
ck.save_checkpoint(run, 3, {"model": {"w": torch.ones(1000) * 3}, "rank": {"x": 3}}, keep_last=2)
"""


def test_sigkill_while_pruning_leaves_no_step_directory_without_manifest(launched):
    p, run = launched["test_sigkill_while_pruning_leaves_no_step_directory_without_manifest"].result()
    assert p.returncode == -9, p.stderr[-2000:]
    left = names(run)
    assert left == [".step_00000001.deleting.tmp", "step_00000002", "step_00000003"], left
    for n in left:  # every step_* directory is complete
        if n.startswith("step_"):
            ck.verify_checkpoint(run / "checkpoints" / n)
    path, _ = ck.find_resume_checkpoint("auto", run)  # a resume cleans up
    assert path.name == "step_00000003" and names(run) == ["step_00000002", "step_00000003"]


def test_resume_removes_step_directories_without_manifest(tmp_path):
    """What older trainers left when killed while pruning (manifest deleted first), and temp dirs."""
    run = tmp_path / "run"
    for step in (1, 2):
        ck.save_checkpoint(run, step, {"model": {"w": torch.ones(3)}, "rank": {"x": step}})
    (run / "checkpoints" / "step_00000001" / "manifest.json").unlink()
    (run / "checkpoints" / ".step_00000003.tmp").mkdir()
    assert ck.find_resume_checkpoint("auto", run)[0].name == "step_00000002"
    assert names(run) == ["step_00000002"]


# ---------------------------------------------------------------- size and free space

@pytest.mark.parametrize("shape", [TINY, dict(dim=128, n_layers=4, n_heads=4, swiglu_hidden=256, max_seq_len=64)],
                         ids=["tiny", "small"])
def test_checkpoint_bytes_estimate_is_within_10_percent(tmp_path, shape):
    model, opt = trained(shape)
    path = ck.save_checkpoint(tmp_path, 1, state_of(model, opt, model_shape=ck.model_shape(model)))
    real = sum(p.stat().st_size for p in path.iterdir())
    with torch.device("meta"):  # as the dry run calls it: nothing allocated
        meta = Transformer(ModelConfig(**shape), FFNConfig(), 512)
    estimate = ck.checkpoint_bytes(meta, "adamw")
    assert abs(estimate - real) <= 0.1 * real, (estimate, real)


def test_space_needed_counts_the_copies_on_disk_at_once():
    assert ck.space_needed(10, saves=5, existing=0, keep_last=3) == 40   # 3 kept + 1 being written
    assert ck.space_needed(10, saves=2, existing=0, keep_last=3) == 20   # fewer saves than keep_last
    assert ck.space_needed(10, saves=5, existing=3, keep_last=3) == 10   # resumed: 3 already on disk
    assert ck.space_needed(10, saves=5, existing=1, keep_last=0) == 50   # keep all
    assert ck.space_needed(10, saves=0, existing=1, keep_last=3) == 0
    assert ck.saves_ahead(0, 300, 100) == 3 and ck.saves_ahead(0, 250, 100) == 3
    assert ck.saves_ahead(100, 300, 100) == 2 and ck.saves_ahead(0, 300, 100, stop_at_step=150) == 2


def test_too_little_space_is_one_line_naming_bytes_and_settings(tmp_path, monkeypatch):
    model, _ = trained()
    each = ck.checkpoint_bytes(model)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: type("U", (), {"free": 3 * each})())
    c = ck.Checkpointer(tmp_path, keep_last=3, asynchronous=False)
    with pytest.raises(CheckpointError) as e:
        c.check_space(model, start=0, steps=1000, ckpt_every=100)
    msg = str(e.value)
    assert "\n" not in msg
    for part in (f"{4 * each / 1e9:.3g} GB needed", f"{3 * each / 1e9:.3g} GB free", "trainer.keep_last",
                 "trainer.ckpt_every", "hydra.run.dir", "trainer.check_space=false", str(tmp_path / "checkpoints")):
        assert part in msg, (part, msg)
    ck.Checkpointer(tmp_path, keep_last=2, asynchronous=False).check_space(model, 0, 1000, 100)  # 3 copies fit


def test_background_saves_warn_when_the_host_copy_does_not_fit(tmp_path, monkeypatch, caplog):
    model, _ = trained()
    each = 3 * sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(ck, "available_host_bytes", lambda: 8 * each - 1)
    ck.Checkpointer(tmp_path, 1, asynchronous=True).check_space(model, 0, 10, 5)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "(8 on this host)" in warned[0] and "trainer.async_checkpoint=false" in warned[0]
    caplog.clear()
    monkeypatch.setattr(ck, "available_host_bytes", lambda: 8 * each)
    ck.Checkpointer(tmp_path, 1, asynchronous=True).check_space(model, 0, 10, 5)
    monkeypatch.setattr(ck, "available_host_bytes", lambda: 0)
    ck.Checkpointer(tmp_path, 1, asynchronous=False).check_space(model, 0, 10, 5)  # no host copy
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_background_saves_reuse_one_host_copy_prepared_ahead_and_freed_at_close(tmp_path, monkeypatch):
    """prepare() allocates the host copy in the writer's thread; three saves copy into that same
    buffer (no allocation), each checkpoint holds the weights of its own step, and close() frees it."""
    from training.host_staging import HostStaging

    made = []
    real_reserve = HostStaging.reserve

    def reserve(self, state_dict):
        before = self._buffer
        real_reserve(self, state_dict)
        if self._buffer is not before:
            made.append(self._buffer.data_ptr())
    monkeypatch.setattr(HostStaging, "reserve", reserve)
    model, opt = trained()
    c = ck.Checkpointer(tmp_path / "run", keep_last=0, asynchronous=True)
    c.prepare(state_of(model, opt))
    c.wait()
    assert len(made) == 1 and not c.wants_prepare
    wanted = {}
    for step in (1, 2, 3):
        wanted[step] = {k: v.clone() for k, v in model.state_dict().items()}
        c.save(step, state_of(model, opt))
        with torch.no_grad():  # the next steps' training, while the write is under way
            for p in model.parameters():
                p.add_(1.0)
    c.close()
    assert len(made) == 1 and c._staging.nbytes == 0  # one allocation; freed
    for step in (1, 2, 3):
        got = ck.load_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{step:08d}")["model"]
        for k, v in wanted[step].items():
            assert torch.equal(got[k], v), (step, k)


def test_host_staging_copies_every_tensor_and_keeps_the_other_values():
    """stage(): tensors become views of one host buffer holding their values now (0-dim and empty
    ones too); numbers, strings, tuples and None are the state's own; a state of another shape gets
    a new buffer."""
    from training.host_staging import ALIGN, HostStaging

    state = {"a": torch.randn(3, 5), "b": {"step": torch.tensor(7.0), "empty": torch.zeros(0, 4),
                                          "i": torch.arange(6, dtype=torch.int64).view(2, 3)},
             "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "params": ["a"]}]}
    s = HostStaging(pinned=False)
    got = s.stage(state)
    assert s.nbytes == 3 * ALIGN  # a page each for a, step and i; none for the empty one
    base = s._buffer.data_ptr()
    for k, v in (("a", got["a"]), ("step", got["b"]["step"]), ("i", got["b"]["i"])):
        assert base <= v.data_ptr() < base + s.nbytes, k
    assert torch.equal(got["a"], state["a"]) and got["a"].data_ptr() != state["a"].data_ptr()
    for v in (got["a"], got["b"]["step"], got["b"]["i"]):  # else DCP's writer clones it: a second copy per save
        assert v.untyped_storage().nbytes() == v.nbytes
    assert got["b"]["step"].item() == 7.0 and got["b"]["step"].dim() == 0
    assert got["b"]["empty"].shape == (0, 4) and torch.equal(got["b"]["i"], state["b"]["i"])
    assert got["groups"] == state["groups"]
    state["a"].add_(1.0)
    state["groups"][0]["lr"] = 0.2
    again = s.stage(state)
    assert s._buffer.data_ptr() == base and torch.equal(again["a"], state["a"]) and again["groups"][0]["lr"] == 0.2
    s.stage({"a": torch.randn(4, 5)})  # another structure
    assert s.nbytes == ALIGN
    s.close()  # DCP may call it after an upload: the copy stays
    assert s.nbytes == ALIGN
    s.release()
    assert s.nbytes == 0


def test_a_bare_key_error_is_named_in_the_reason():
    assert ck._reason(KeyError(type)) == "KeyError: <class 'type'>"
    assert ck._reason(OSError(28, "No space left on device")) == "No space left on device"


@pytest.mark.gpu
def test_background_saves_of_cuda_state_through_page_locked_host_memory(tmp_path):
    """On a GPU: the host copy is page-locked, and three background saves of a model and AdamW
    on the device (DCP may close the stager after each upload) hold each step's weights."""
    m = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    m(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    c = ck.Checkpointer(tmp_path, keep_last=0, asynchronous=True)
    c.prepare(dict(zip(("model", "optimizer"), get_state_dict(m, opt))))
    c.wait()
    assert c._staging._buffer.is_pinned()
    wanted = {}
    for step in (1, 2, 3):
        wanted[step] = m.weight.detach().cpu().clone()
        msd, osd = get_state_dict(m, opt)
        c.save(step, {"model": msd, "optimizer": osd, "rank": {"x": step}})
        opt.step()  # changes the weights while the write is under way
    c.close()
    for step in (1, 2, 3):
        got = ck.load_checkpoint(tmp_path / "checkpoints" / f"step_{step:08d}")["model"]
        assert torch.equal(got["weight"], wanted[step]), step


def test_a_save_that_waits_for_the_previous_write_says_so(tmp_path, gate, caplog):
    caplog.set_level(logging.INFO, logger="training.checkpoint")
    release, entered = gate
    model, opt = trained()
    c = ck.Checkpointer(tmp_path, keep_last=0, asynchronous=True)
    c.save(2, state_of(model, opt))  # held in the writer by the gate
    assert entered.wait(30)
    threading.Timer(1.5, release.set).start()
    c.save(3, state_of(model, opt))
    c.close()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "checkpoint step 3: waited" in warned[0] and "trainer.ckpt_every" in warned[0]
