"""Start-up checks of the composed config, in one place: the valid range of every numeric setting
(RANGES), the checks that relate settings to each other, the start-up warnings, and which
settings a resume may not change. Each failure is one ConfigError line that names the setting,
its value and what would be valid; train.py prints it and exits 2 before anything is written."""
import logging
import math
import re
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Optional

import torch

from data.tokenizer import MIN_VOCAB_SIZE
from model.config import ModelConfig, attention_shape_problem, ffn_hidden_dim
from model.ffn import FFN, ffn_class

from .config import Config, TrainerConfig, pairs_grad_unscaling
from .cuda_graph import graph_problem
from .errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Range:
    """lo <= v <= hi (an open end excludes it), or one of `also`; None is valid for Optional fields."""
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    also: tuple = ()
    what: str = ""  # what the special values mean

    def ok(self, v) -> bool:
        if v is None or v in self.also:  # None: an Optional field's default (the schema refuses it elsewhere)
            return True
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below and not (isinstance(v, float) and math.isnan(v))

    def __str__(self) -> str:
        if self.hi == math.inf:
            text = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            text = f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        if self.also:
            text = f"{' or '.join(map(str, self.also))} ({self.what}) or {text}"
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE, NON_NEGATIVE, FRACTION = Range(0, lo_open=True), Range(0), Range(0, 1)
STEP_OR_OFF = Range(0, lo_open=True, also=(-1,), what="off")

# The valid range of every numeric setting of every schema (model/config.py, data/config.py,
# training/config.py); tests/test_config.py walks the dataclasses and fails on a numeric field
# missing here. Optional fields also take null.
RANGES = {
    "model.dim": POSITIVE, "model.n_layers": POSITIVE, "model.n_heads": POSITIVE, "model.n_kv_heads": POSITIVE,
    "model.swiglu_hidden": POSITIVE, "model.vocab_size": POSITIVE, "model.max_seq_len": POSITIVE,
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE, "model.init_std": POSITIVE,
    "ffn.hidden_dim": POSITIVE, "ffn.dense_warmup_steps": NON_NEGATIVE,
    "ffn.dense_feature_fraction": Range(0, 1, hi_open=True), "ffn.sparse_gemm_alg": NON_NEGATIVE,
    "data.max_documents": POSITIVE, "data.vocab_size": Range(MIN_VOCAB_SIZE),  # byte-level BPE's alphabet
    "data.tokenizer_train_documents": POSITIVE, "data.val_fraction": Range(0, 1, lo_open=True, hi_open=True),
    "data.shard_tokens": POSITIVE,
    "optim.lr": NON_NEGATIVE, "optim.min_lr_ratio": FRACTION, "optim.beta1": Range(0, 1, hi_open=True),
    "optim.beta2": Range(0, 1, hi_open=True), "optim.eps": POSITIVE, "optim.weight_decay": NON_NEGATIVE,
    "optim.grad_clip": NON_NEGATIVE, "optim.warmup_steps": NON_NEGATIVE, "optim.decay_fraction": FRACTION,
    "trainer.seed": NON_NEGATIVE,  # numpy's generators take no negative seed
    "trainer.seq_len": POSITIVE, "trainer.batch_size": POSITIVE, "trainer.micro_batch_size": POSITIVE,
    "trainer.total_tokens": POSITIVE, "trainer.max_steps": Range(0, lo_open=True, also=(-1,), what="the token budget"),
    "trainer.stop_at_step": STEP_OR_OFF, "trainer.eval_every": POSITIVE, "trainer.eval_batches": POSITIVE,
    "trainer.log_every": POSITIVE, "trainer.ffn_stats_every": NON_NEGATIVE, "trainer.ckpt_every": POSITIVE, "trainer.keep_last": NON_NEGATIVE,
    "trainer.dist_timeout_s": POSITIVE, "trainer.num_threads": NON_NEGATIVE, "trainer.memory_capacity_gib": POSITIVE,
}

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def numeric_fields(node=Config, prefix: str = "") -> list[str]:
    """Every int / float / Optional[int|float] field of the schema, as dotted keys."""
    out = []
    for f in fields(node):
        key, t = f"{prefix}{f.name}", f.type
        sub = f.default_factory if is_dataclass(f.default_factory) else None
        if sub is not None:
            out += numeric_fields(sub, f"{key}.")
        elif t in (int, float, Optional[int], Optional[float]) and t is not bool:
            out.append(key)
    return out


def check_config(cfg: Config, world_size: int = 1, rank: int = 0) -> None:
    """Raise ConfigError for the first setting that cannot work; log the start-up warnings (rank 0)."""
    for key, r in RANGES.items():
        v = _get(cfg, key)
        if not r.ok(v):
            raise ConfigError(f"{key}={v} is out of range: valid is {r}")
    m, f, t = cfg.model, cfg.ffn, cfg.trainer
    hidden = ffn_hidden_dim(m, f)
    q = ffn_class(f.kind).hidden_multiple  # srelu24: the 2:4 sparse GEMM layout
    if hidden % q:
        lo, hi = hidden // q * q, (hidden // q + 1) * q
        raise ConfigError(f"ffn={f.kind} needs a hidden size that is a multiple of {q}, got {hidden}; "
                          f"set ffn.hidden_dim={lo or hi} or {hi}")
    if hidden <= 0:
        raise ConfigError(f"the FFN hidden size must be positive, got {hidden} (ffn.hidden_dim / model.swiglu_hidden)")
    problem = attention_shape_problem(m)
    if problem:
        raise ConfigError(problem)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.batch_size % (t.micro_batch_size * world_size):
        raise ConfigError(f"trainer.batch_size={t.batch_size} must be a multiple of trainer.micro_batch_size="
                          f"{t.micro_batch_size} x {world_size} rank(s)")
    if total_steps(t) <= 0:
        raise ConfigError(f"trainer.total_tokens={t.total_tokens} is less than one step of "
                          f"{t.batch_size * t.seq_len} tokens; raise it or set trainer.max_steps")
    if t.ffn_stats_every % t.log_every:
        lo = t.ffn_stats_every // t.log_every * t.log_every
        raise ConfigError(f"trainer.ffn_stats_every={t.ffn_stats_every} must be 0 or a multiple of trainer.log_every="
                          f"{t.log_every} (statistics are logged with a step's row); set "
                          f"{lo if lo else '0 (every logged step)'} or {lo + t.log_every}")
    if (pairs_grad_unscaling(m, f, t, t.batch_size > t.micro_batch_size * world_size)
            and (t.micro_batch_size * t.seq_len) % 64):
        raise ConfigError(f"ffn.paired_grad_unscaling=true needs the tokens of a micro-batch a multiple of 64 "
                          f"(sm90's e4m3 layout), got trainer.micro_batch_size={t.micro_batch_size} x "
                          f"trainer.seq_len={t.seq_len}; set ffn.paired_grad_unscaling=false")
    if t.nonfinite not in ("skip", "stop"):
        raise ConfigError(f"trainer.nonfinite={t.nonfinite}: valid values are skip, stop")
    if t.precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"trainer.precision={t.precision}: valid values are auto, bf16, fp32")
    if not _DEVICE.match(t.device):
        raise ConfigError(f"trainer.device={t.device}: valid values are auto, cpu, cuda, cuda:N")
    # a dry run plans a GPU run from any machine (its memory verdict counts the graph's pool)
    cpu = not t.dry_run and (t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available()))
    problem = graph_problem(t.cuda_graph, world_size, t.strategy.value, t.activation_checkpointing.value,
                            m.attention.value, torch.device("cpu") if cpu else None)
    if problem:
        raise ConfigError(problem)
    if t.resume not in ("none", "auto") and not Path(t.resume).is_dir():
        raise ConfigError(f"trainer.resume={t.resume}: valid values are none, auto or the path of a checkpoint "
                          "directory (checkpoints/step_XXXXXXXX)")
    for key in t.resume_overrides:
        if not _guarded(key) and not any(g.startswith(f"{key}.") for g in GUARDED):
            raise ConfigError(f"trainer.resume_overrides: {key} is not a setting that resume checks; they are "
                              f"{', '.join(GUARDED)} and the keys under them")
    if rank == 0:
        for warning in startup_warnings(cfg):
            log.warning(warning)


def startup_warnings(cfg: Config) -> list[str]:
    """Settings that run but probably not as meant."""
    out, f, steps = [], cfg.ffn, total_steps(cfg.trainer)
    has_2to4 = ffn_class(f.kind).set_2to4 is not FFN.set_2to4  # dense variants keep the base's no-op
    if has_2to4 and f.dense_warmup_steps >= steps:
        out.append(f"ffn={f.kind} with ffn.dense_warmup_steps={f.dense_warmup_steps} at or past the run's last step "
                   f"({steps}): 2:4 never turns on, the run is plain srelu; lower ffn.dense_warmup_steps")
    return out


def total_steps(t: TrainerConfig) -> int:
    return t.max_steps if t.max_steps > 0 else t.total_tokens // (t.batch_size * t.seq_len)


def resolve_vocab_size(m: ModelConfig, data_vocab: int) -> int:
    """The model's vocabulary: the tokenizer's, or a larger padded size; never smaller."""
    if m.vocab_size is None:
        return data_vocab
    if m.vocab_size < data_vocab:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the shards' tokenizer vocabulary "
                          f"({data_vocab}); set model.vocab_size>={data_vocab} or null")
    return m.vocab_size


# ---------------------------------------------------------------- resume

# What a resume may not change without saying so (trainer.resume_overrides): the model and its
# FFN, the optimizer and LR schedule, and what sets the schedule's length and the data order.
GUARDED = ("model", "ffn", "optim", "trainer.seed", "trainer.seq_len", "trainer.batch_size", "trainer.max_steps",
           "trainer.total_tokens")
# under a guarded group but not the computation: a label, or an implementation of the same math
UNGUARDED = ("model.name", "ffn.kernels", "ffn.sparse_gemm_alg", "ffn.paired_grad_unscaling", "optim.fused")


def _guarded(key: str) -> bool:
    return key not in UNGUARDED and any(key == g or key.startswith(f"{g}.") for g in GUARDED)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume(path: Path, saved: Optional[dict], now: dict, allowed: list[str]) -> list[str]:
    """Compare the checkpoint's resolved config with this run's: a guarded setting that differs
    and is not in `allowed` (keys or groups) raises ConfigError naming each; returns the allowed
    changes as `key: old -> new` (for the log)."""
    if saved is None:
        return []
    old, new = _flat(saved), _flat(now)
    changed = [k for k in sorted(set(old) | set(new)) if _guarded(k) and old.get(k) != new.get(k)]
    ok = lambda k: any(k == a or k.startswith(f"{a}.") for a in allowed)  # noqa: E731
    refused = [k for k in changed if not ok(k)]
    if refused:
        diff = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in refused)
        raise ConfigError(f"resuming {path} would change {diff} (the run's schedule or model would change mid-run); "
                          f"resume with the checkpoint's settings, or allow it with "
                          f"trainer.resume_overrides=[{','.join(refused)}]")
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in changed]
