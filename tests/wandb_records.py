"""Read an offline wandb run file (.wandb) back: a LevelDB-style log of protobuf Records.

wandb >= 0.20 no longer ships a Python reader, so the tests carry this small one. Format:
a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768


def settled(path: Path, timeout_s: float = 20.0) -> bytes:
    """The file's bytes once its size has held for 0.5 s (at most timeout_s): the offline writer
    can still be flushing just after the run's finish() returns on a loaded machine (a run file
    was once read with no run record in it under the full suite)."""
    deadline, last = time.monotonic() + timeout_s, -1
    while True:
        size = Path(path).stat().st_size
        if size == last or time.monotonic() > deadline:
            return Path(path).read_bytes()
        last = size
        time.sleep(0.5)


def records(path: Path):
    data = settled(path)
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at a block's end
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def history_keys(path: Path) -> set[str]:
    keys = set()
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            keys.update(item.key or "/".join(item.nested_key) for item in rec.history.item)
    return keys


def run_info(path: Path) -> dict:
    """The run record: group, job type, name, and the config's top-level keys."""
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            r = rec.run
            return {"group": r.run_group, "job_type": r.job_type, "name": r.display_name,
                    "config_keys": {item.key for item in r.config.update}}
    raise AssertionError(f"no run record in {path}")
