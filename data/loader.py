"""Deterministic, resumable batches of token windows read from memory-mapped shards."""
from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch

from .errors import DataError
from .shards import Manifest


def batch_to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A CPU batch (the loader's x, y) on `device`, without the host waiting for the GPU.

    To a GPU it goes through page-locked memory: a copy from pageable memory may first wait for
    the work queued on the stream (CUDA's "API synchronization behavior"), after which the GPU idles
    while the host prepares the rest of the micro-batch, srelu24's token orders among it. The
    page-locked block is torch's caching host allocator's, reused only once the copy from it has
    run."""
    if device.type != "cuda":
        return x.to(device), y.to(device)
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


class TokenLoader:
    """Batches of non-overlapping windows of one split, shuffled per epoch from (seed, epoch).

    Sample index i (counted over all ranks) is window perm_e[i % W], e = i // W. Each next_batch
    consumes batch_size * world_size indices; this rank takes its own contiguous batch_size of them.
    So batches depend only on seed and step, ranks never overlap, and resuming is exact.
    """

    def __init__(self, shard_dir: Path, manifest: Manifest, split: str, seq_len: int, batch_size: int,
                 seed: int, rank: int = 0, world_size: int = 1):
        if split not in manifest.splits:
            raise DataError(f"split {split!r} is not in {shard_dir}; splits: {sorted(manifest.splits)}")
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"trainer.seq_len={seq_len} and batch_size={batch_size} must both be >= 1")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.vocab_size, self.shard_dir, self.manifest = manifest.vocab_size, Path(shard_dir), manifest
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.samples_seen = 0
        shard_dir = Path(shard_dir)
        self._shards = [np.memmap(shard_dir / s["file"], dtype=manifest.dtype, mode="r", shape=(s["tokens"],))
                        for s in manifest.splits[split] if s["tokens"]]
        # _starts[k] = position of shard k's first token in the split's concatenated stream
        self._starts = np.cumsum([0] + [len(m) for m in self._shards])
        self.n_tokens = int(self._starts[-1])
        self.n_windows = max(0, (self.n_tokens - 1) // seq_len)  # +1 token for the shifted target
        if self.n_windows == 0:
            more = " (or raise data.val_fraction)" if split == "val" else ""
            raise DataError(
                f"trainer.seq_len={seq_len} is too long for the {split} split of {shard_dir} "
                f"({self.n_tokens} tokens): lower it{more}; a window needs seq_len + 1 tokens")
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # only the current epoch's is kept: W ints can be large
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def _window(self, j: int, out: np.ndarray) -> None:
        """Copy window j (seq_len + 1 tokens), stitched across shard boundaries, into out."""
        start, end = j * self.seq_len, j * self.seq_len + self.seq_len + 1
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = 0
        while start < end:
            lo = start - self._starts[k]
            take = min(end - start, len(self._shards[k]) - lo)
            out[pos:pos + take] = self._shards[k][lo:lo + take]
            pos, start, k = pos + take, start + take, k + 1

    def _batch(self, windows) -> Tuple[torch.Tensor, torch.Tensor]:
        buf = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        for row, j in enumerate(windows):
            self._window(int(j), buf[row])
        if buf.size and buf.max() >= self.vocab_size:  # a corrupted shard: ids the model has no row for
            self._bad_token(windows)
        t = torch.from_numpy(buf)
        # contiguous: callers may .view() them (e.g. targets.view(-1) in the loss)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def _bad_token(self, windows) -> None:
        for j in windows:
            start = int(j) * self.seq_len
            k = int(np.searchsorted(self._starts, start, side="right")) - 1
            shards = [s for s in self.manifest.splits[self.split] if s["tokens"]]
            w = np.empty(self.seq_len + 1, dtype=np.int64)
            self._window(int(j), w)
            if w.max() >= self.vocab_size:
                raise DataError(f"{self.shard_dir / shards[k]['file']} holds token id {int(w.max())} at or past "
                                f"the vocabulary size {self.vocab_size} (near token {start - int(self._starts[k])}): "
                                "the shard is corrupted; prepare the data again")

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch: CPU int64 x, y of shape [batch_size, seq_len]."""
        first = self.samples_seen + self.rank * self.batch_size
        windows = []
        for i in range(first, first + self.batch_size):
            epoch, k = divmod(i, self.n_windows)
            windows.append(self._permutation(epoch)[k])
        self.samples_seen += self.batch_size * self.world_size
        return self._batch(windows)

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen, "seed": self.seed, "seq_len": self.seq_len, "split": self.split}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "split"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"cannot resume the {self.split} loader: checkpoint has {key}={state.get(key)!r}, "
                    f"config has {key}={getattr(self, key)!r}")
        self.samples_seen = int(state["samples_seen"])

    def fixed_batches(self, n_batches: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The first n_batches * batch_size windows in order (the same on every call and rank).

        A split too small for that gives fewer; the last batch may then be smaller than batch_size.
        (A split without a single window already failed in __init__, naming data.val_fraction.)
        """
        n = min(n_batches * self.batch_size, self.n_windows)
        return [self._batch(range(b, min(b + self.batch_size, n))) for b in range(0, n, self.batch_size)]
