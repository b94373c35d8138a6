"""Peak GPU memory of a training step, estimated from the config (the dry run prints it), and the
bytes of one checkpoint.

What one GPU holds, for T = micro_batch_size x seq_len tokens, P parameters (P_b of one block):
- parameters (fp32 master weights), 4 P; AdamW's exp_avg and exp_avg_sq, 8 P; gradients, 4 P.
  FSDP divides the three by the world size and adds the all-gathered bf16 copies of the root
  (embedding, LM head) and of two blocks (the one running and the prefetched one). DDP adds its
  gradient buckets, another 4 P (gradient_as_bucket_view is off).
- activations kept for the backward, per block and token (bf16 unless said):
    the residual stream twice (fp32 under autocast, bf16 under FSDP's bf16 parameters) and its
    two normalised copies, q, k, v and the attention output (k, v with n_kv_heads), and the FFN's:
    swiglu its gate, up and product (3 hidden vectors), srelu Z and A = relu(Z)^2 (2), srelu24
    in its 2:4 phase the compressed A24 alone (the kept half of the values plus 2-bit metadata:
    9/16 of Z's bytes); in its dense warmup it keeps what srelu keeps.
  A checkpointed block (trainer.activation_checkpointing) keeps only its input and recomputes
  the rest in its backward.
- the largest transient, at the start of the backward, the larger of
    the loss head's backward: bf16 logits and their gradient (2 x 2 T V bytes), and the LM head's
    fp32 weight gradient;
    a block's backward: its weight gradients (in bf16, in fp32, the autocast copies of its
    weights: 8 bytes per parameter beside its fp32 .grad), 16 bytes per token and model dimension
    (the incoming gradient in fp32, dq/dk/dv, FlashAttention's fp32 dq accumulator), and, for a
    checkpointed block, its recomputed activations.
Gradients are allocated during the backward as the activations are freed, so without gradient
accumulation the peak is the larger of (start of the backward: weights + AdamW + activations +
transient) and (the optimizer step: weights + AdamW + gradients). With accumulation (the trainer's
batch_size > micro_batch_size x world size) the gradients of the earlier micro-batches are there
throughout, and so, for srelu24 with trainer.float8 and its 2:4 GEMMs in e4m3 on fp32 weights (no
FSDP), are its kept e4m3 weight conversions (kernels/weight_casts.py): four of d x F bytes per
layer, until the optimizer step.

The two per-token constants of the transients (16 bytes per d, 8 per parameter) and the 20 bytes
per d of the block's kept activations are calibrated against torch.cuda.max_memory_allocated of
compiled bf16 steps on an H200 (scripts/bench_step.py and the trainer): 1B with 16 and 20 layers,
7B with 8 layers, srelu, srelu24 and swiglu, within 5%; tests/test_memory.py holds those
measurements. An eager step (trainer.compile=false) keeps more; the fp32 precision's activations are
counted at twice the bytes. The srelu24 figure assumes the CUDA sparsify kernels (`make kernels`);
the Triton path keeps Z (2 bytes per hidden unit) instead of A24.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from model import FFNConfig, ModelConfig, Transformer, ffn_hidden_dim

from .checkpoint import checkpoint_bytes
from .config import ActivationCheckpointing, Config, Float8, Strategy, TrainerConfig

GiB = 2 ** 30
# calibrated (see the docstring): bytes per token and model dimension
RESIDUAL_BACKWARD_BYTES_PER_D = 16   # a block's backward: fp32 incoming gradient, dq/dk/dv, fp32 dq accumulator
BLOCK_GRAD_TRANSIENT_BYTES = 8       # per parameter of the block in backward, beside its fp32 .grad
FFN_KEPT = {"swiglu": 3.0, "srelu": 2.0}  # bf16 hidden-sized tensors kept for the backward
A24_OF_Z = 9 / 16                    # srelu24's compressed A24 against Z: half the values + 2 bits each
KEPT_CONVERSIONS = "srelu24's kept e4m3 weight conversions"


@dataclass
class MemoryEstimate:
    """Bytes per GPU; `parts` in the order printed, `peak` their maximum over the step."""
    parts: dict = field(default_factory=dict)
    transient: str = ""       # which transient is the largest
    peak_phase: str = ""      # "backward" (start of the backward) or "optimizer step"
    peak: int = 0


def _counts(model: Transformer) -> tuple[int, int, int]:
    """Unique parameters, those of one block, and of the root (embedding, final norm, LM head)."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    block = sum(p.numel() for p in model.layers[0].parameters())
    return total, block, total - block * len(model.layers)


def _meta_model(mcfg: ModelConfig, fcfg: FFNConfig, vocab: int) -> Transformer:
    with torch.device("meta"):
        return Transformer(mcfg, fcfg, vocab)


def block_activation_bytes(mcfg: ModelConfig, fcfg: FFNConfig, sparse_2to4: bool, residual_bytes: int,
                           act_bytes: int) -> float:
    """Bytes per token that one block keeps for its backward."""
    d = mcfg.dim
    d_kv = (mcfg.n_kv_heads or mcfg.n_heads) * (d // mcfg.n_heads)
    h = ffn_hidden_dim(mcfg, fcfg)
    kind = fcfg.kind
    if kind == "srelu24" and sparse_2to4:
        ffn = A24_OF_Z * act_bytes * h
    else:
        # a variant not listed is counted as swiglu, which keeps the most
        ffn = FFN_KEPT.get("srelu" if kind == "srelu24" else kind, FFN_KEPT["swiglu"]) * act_bytes * h
    # residual stream in and after attention; their normalised copies; q, o and k, v
    return 2 * residual_bytes * d + 2 * act_bytes * d + act_bytes * (2 * d + 2 * d_kv) + ffn


def estimate(mcfg: ModelConfig, fcfg: FFNConfig, vocab: int, t: TrainerConfig, world_size: int = 1,
             grad_accumulation: Optional[bool] = None, sparse_2to4: Optional[bool] = None,
             bf16: Optional[bool] = None) -> MemoryEstimate:
    """Peak memory per GPU of one training step. grad_accumulation: None = the trainer's
    (batch_size > micro_batch_size x world_size); sparse_2to4 (srelu24): None = its 2:4 phase;
    bf16: None = trainer.precision auto/bf16 (a GPU)."""
    if grad_accumulation is None:
        grad_accumulation = t.batch_size > t.micro_batch_size * world_size
    kind = fcfg.kind
    sparse_2to4 = kind == "srelu24" and (sparse_2to4 is None or sparse_2to4)
    bf16 = t.precision != "fp32" if bf16 is None else bf16
    fsdp, ddp = t.strategy == Strategy.fsdp, t.strategy == Strategy.ddp
    shard = world_size if fsdp else 1
    act = 2 if bf16 else 4
    residual = 2 if (fsdp and bf16) else 4  # FSDP's bf16 parameters: no fp32 residual stream

    model = _meta_model(mcfg, fcfg, vocab)
    P, P_block, P_root = _counts(model)
    L, d, T = mcfg.n_layers, mcfg.dim, t.micro_batch_size * t.seq_len
    n_ckpt = {ActivationCheckpointing.none: 0, ActivationCheckpointing.selective: math.ceil(L / 2),
              ActivationCheckpointing.full: L}[t.activation_checkpointing]
    per_block = block_activation_bytes(mcfg, fcfg, sparse_2to4, residual, act) * T

    e = MemoryEstimate()
    e.parts["parameters (fp32)"] = 4 * P // shard
    e.parts["optimizer state (AdamW, fp32)"] = 8 * P // shard
    e.parts["gradients (fp32)"] = 4 * P // shard
    if ddp:
        e.parts["DDP gradient buckets"] = 4 * P
    if fsdp:
        e.parts["FSDP all-gathered bf16 weights"] = (2 if bf16 else 4) * (P_root + 2 * P_block)
    e.parts["activations"] = int((L - n_ckpt) * per_block + n_ckpt * residual * d * T)

    out_grad = 0 if grad_accumulation else 4 * vocab * d // shard  # else: already in the gradients
    head = 2 * act * T * vocab + out_grad
    block = (out_grad + (0 if grad_accumulation else 4 * P_block // shard) + BLOCK_GRAD_TRANSIENT_BYTES * P_block
             + RESIDUAL_BACKWARD_BYTES_PER_D * (act // 2) * d * T + (per_block if n_ckpt else 0))
    e.transient = "loss head backward" if head >= block else "block backward"
    e.parts[f"largest transient ({e.transient})"] = int(max(head, block))
    if grad_accumulation and sparse_2to4 and not fsdp and t.float8 != Float8.none and fcfg.sparse_float8:
        # W1's rows and columns, W2's rows and columns: 4 per layer of d x F bytes (e4m3)
        e.parts[KEPT_CONVERSIONS] = 4 * d * ffn_hidden_dim(mcfg, fcfg) * L

    resident = sum(v for k, v in e.parts.items() if k not in ("gradients (fp32)", "activations", KEPT_CONVERSIONS)
                   and not k.startswith("largest transient"))
    backward = resident + e.parts["activations"] + max(head, block) + (e.parts["gradients (fp32)"]
                                                                        if grad_accumulation else 0)
    backward += e.parts.get(KEPT_CONVERSIONS, 0)
    step = resident + e.parts["gradients (fp32)"]
    e.peak, e.peak_phase = (int(backward), "backward") if backward >= step else (int(step), "optimizer step")
    return e


def world_size_of_launch(t: TrainerConfig) -> int:
    """The world size torchrun or SLURM launched (1 without one)."""
    from .distributed import launch_env

    launch = launch_env(slurm=t.strategy != Strategy.none)
    return launch.world_size if launch else 1


def dry_run_rows(cfg: Config, vocab: int) -> list[tuple[str, str]]:
    """The dry run's memory rows: peak per GPU with its breakdown (srelu24: its dense warmup and its
    2:4 phase), and one checkpoint's bytes."""
    t = cfg.trainer
    world = world_size_of_launch(t)
    phases = [("", None)]
    if cfg.ffn.kind == "srelu24":
        phases = [(" (srelu24 dense warmup)", False), (" (srelu24 2:4)", True)]
    setup = (f"{world} GPU(s), strategy {t.strategy.value}, activation checkpointing "
             f"{t.activation_checkpointing.value}, micro-batch {t.micro_batch_size} x {t.seq_len}")
    rows, first = [("memory per GPU, estimated for", setup)], None
    for name, sparse in phases:
        e = estimate(cfg.model, cfg.ffn, vocab, t, world, sparse_2to4=sparse)
        rows.append((f"  peak{name}", f"{e.peak / GiB:.1f} GiB (at the {e.peak_phase})"))
        # a second phase: only what differs from the first
        rows += [(f"    {k}", f"{v / GiB:.2f} GiB") for k, v in e.parts.items() if first is None or first.get(k) != v]
        first = first or e.parts
    size = checkpoint_bytes(_meta_model(cfg.model, cfg.ffn, vocab), "adamw", world)  # the one definition
    rows.append(("checkpoint size (weights + AdamW)", f"{size / 1e9:.3g} GB"))
    return rows
