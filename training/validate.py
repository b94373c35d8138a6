"""Checks that need more than a type: each failure names the setting and what would be valid."""
from pathlib import Path

from model.config import ModelConfig, ffn_hidden_dim
from model.ffn import ffn_class

from .config import Config, TrainerConfig
from .errors import ConfigError


def validate(cfg: Config, world_size: int = 1) -> None:
    m, f, t = cfg.model, cfg.ffn, cfg.trainer
    hidden = ffn_hidden_dim(m, f)
    q = ffn_class(f.kind).hidden_multiple  # srelu24: the 2:4 sparse GEMM layout
    if hidden % q:
        lo, hi = hidden // q * q, (hidden // q + 1) * q
        raise ConfigError(f"ffn={f.kind} needs a hidden size that is a multiple of {q}, got {hidden}; "
                          f"set ffn.hidden_dim={lo or hi} or {hi}")
    if hidden <= 0:
        raise ConfigError(f"the FFN hidden size must be positive, got {hidden} (ffn.hidden_dim / model.swiglu_hidden)")
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads}")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"the head size model.dim/model.n_heads={m.dim // m.n_heads} must be even for RoPE")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if not 0 <= f.dense_feature_fraction < 1:
        raise ConfigError(f"ffn.dense_feature_fraction={f.dense_feature_fraction} must be in [0, 1)")
    if f.dense_warmup_steps < 0:
        raise ConfigError(f"ffn.dense_warmup_steps={f.dense_warmup_steps} must be >= 0")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.micro_batch_size <= 0 or t.batch_size % (t.micro_batch_size * world_size):
        raise ConfigError(f"trainer.batch_size={t.batch_size} must be a multiple of trainer.micro_batch_size="
                          f"{t.micro_batch_size} x {world_size} rank(s)")
    if total_steps(t) <= 0:
        raise ConfigError(f"trainer.total_tokens={t.total_tokens} is less than one step of "
                          f"{t.batch_size * t.seq_len} tokens; raise it or set trainer.max_steps")
    for key in ("log_every", "eval_every", "ckpt_every", "eval_batches"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"trainer.{key}={getattr(t, key)} must be positive")
    if t.nonfinite not in ("skip", "stop"):
        raise ConfigError(f"trainer.nonfinite={t.nonfinite}: valid values are skip, stop")
    if t.keep_last < 0:
        raise ConfigError(f"trainer.keep_last={t.keep_last} must be >= 0 (0 keeps all)")
    if t.precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"trainer.precision={t.precision}: valid values are auto, bf16, fp32")
    if t.resume not in ("none", "auto") and not Path(t.resume).is_dir():
        raise ConfigError(f"trainer.resume={t.resume}: valid values are none, auto or the path of a checkpoint "
                          "directory (checkpoints/step_XXXXXXXX)")
    if t.dist_timeout_s <= 0:
        raise ConfigError(f"trainer.dist_timeout_s={t.dist_timeout_s} must be positive")


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
