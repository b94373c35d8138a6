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
  A compiled block under float8 (trainer.float8 with trainer.compile; either recipe) keeps less, as
  the partitioner saves what the float8 backward reads (tests/test_memory.py traces a block on the
  CPU): neither normalised copy (their casts are remade from the residual stream) but the FFN
  input's e4m3 cast (a byte per d), and one hidden vector fewer (srelu Z without A, swiglu gate and
  up without their product: recomputed). srelu24's 2:4 op keeps X's e4m3 cast too where it makes
  one (tensorwise, its e4m3 GEMMs, tokens and F multiples of 64; else X itself), and its block the
  attention output's e4m3 cast, which the dense blocks remake. Float8 linears cast their fp32
  weights to e4m3 directly: no autocast bf16 copies of them (a linear float8 does not convert, a
  dimension not a multiple of 16, keeps its copy).
  A checkpointed block (trainer.activation_checkpointing) keeps only its input and recomputes
  the rest in its backward.
- the largest transient, at the start of the backward, the larger of
    the loss head's backward: bf16 logits and their gradient (2 x 2 T V bytes), and the LM head's
    fp32 weight gradient;
    a block's backward: its weight gradients (in bf16, in fp32, the autocast copies of its
    weights: 8 bytes per parameter beside its fp32 .grad; counted under float8 too, where the
    copies are e4m3 casts), 16 bytes per token and model dimension
    (the incoming gradient in fp32, dq/dk/dv, FlashAttention's fp32 dq accumulator), and, for a
    checkpointed block, its recomputed activations.
Gradients are allocated during the backward as the activations are freed, so without gradient
accumulation the peak is the larger of (start of the backward: weights + AdamW + activations +
transient) and (the optimizer step: weights + AdamW + gradients). With accumulation (the trainer's
batch_size > micro_batch_size x world size) the gradients of the earlier micro-batches are there
throughout, and so, for srelu24 with trainer.float8 and its 2:4 GEMMs in e4m3 on fp32 weights (no
FSDP), are its kept e4m3 weight conversions (srelu24_kernels/srelu24/op.py, convert_weights): four
of d x F bytes per layer, until the optimizer step; under tensorwise they are kept with one
micro-batch too (model/ffn.py, conversions_kept). With ffn.paired_grad_unscaling (tensorwise,
accumulation, one process) one micro-batch's bf16 weight-gradient products wait for the next: two of 2 x d x F
bytes per layer.

The two per-token constants of the transients (16 bytes per d, 8 per parameter) and the 20 bytes
per d of the block's kept activations are calibrated against torch.cuda.max_memory_allocated of
compiled bf16 steps on an H200 (scripts/bench_step.py and the trainer): 1B with 16 and 20 layers,
7B with 8 layers, srelu, srelu24 and swiglu, within 5%; tests/test_memory.py holds those
measurements, and four compiled float8 trainers' peak reserved bytes on an H100 (1B with CUDA
graphs, 7B shapes without; srelu and srelu24), which the float8 rows meet within 3%. An eager step
(trainer.compile=false) keeps more; the fp32 precision's activations are counted at twice the bytes. The srelu24 figure assumes the CUDA sparsify kernels (`make kernels`);
the Triton path keeps Z (2 bytes per hidden unit) instead of A24.
"""
import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from model import FFNConfig, ModelConfig, Transformer, ffn_hidden_dim
from model.ffn import keeps_conversions

from .checkpoint import checkpoint_bytes, saves_ahead, space_needed
from .config import ActivationCheckpointing, Config, Float8, Strategy, TrainerConfig, pairs_grad_unscaling
from .config_checks import total_steps

GiB = 2 ** 30
# calibrated (see the docstring): bytes per token and model dimension
RESIDUAL_BACKWARD_BYTES_PER_D = 16   # a block's backward: fp32 incoming gradient, dq/dk/dv, fp32 dq accumulator
BLOCK_GRAD_TRANSIENT_BYTES = 8       # per parameter of the block in backward, beside its fp32 .grad
FFN_KEPT = {"swiglu": 3.0, "srelu": 2.0}  # bf16 hidden-sized tensors kept for the backward
FFN_KEPT_FLOAT8 = {"swiglu": 2.0, "srelu": 1.0}  # the same, compiled under float8 (one recomputed)
A24_OF_Z = 9 / 16                    # srelu24's compressed A24 against Z: half the values + 2 bits each
KEPT_CONVERSIONS = "srelu24's kept e4m3 weight conversions"
PAIRED_PRODUCTS = "srelu24's kept weight-gradient products (ffn.paired_grad_unscaling)"
WEIGHT_COPIES = "bf16 copies of the blocks' weights (autocast)"
GRAPH_POOL = "CUDA graph's pool (a micro-batch's activations, kept)"


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 10 * GiB else f"{n / GiB:.3g} GiB"


@dataclass
class MemoryEstimate:
    """Bytes per GPU; `parts` in the order printed, `peak` their maximum over the step."""
    parts: dict = field(default_factory=dict)
    transient: str = ""       # which transient is the largest
    peak_phase: str = ""      # "backward" (start of the backward) or "optimizer step"
    peak: int = 0


_COUNTS: dict = {}  # the search of settings that fit estimates one model shape many times


def _counts(mcfg: ModelConfig, fcfg: FFNConfig, vocab: int) -> tuple[int, int, int]:
    """Unique parameters, those of one block, and of the root (embedding, final norm, LM head)."""
    key = (repr(mcfg), repr(fcfg), vocab)
    if key not in _COUNTS:
        model = _meta_model(mcfg, fcfg, vocab)
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        block = sum(p.numel() for p in model.layers[0].parameters())
        _COUNTS[key] = total, block, total - block * len(model.layers)
    return _COUNTS[key]


def _unconverted_block_weights(mcfg: ModelConfig, fcfg: FFNConfig, vocab: int, sparse_2to4: bool) -> int:
    """Weights of one block's linears that trainer.float8 leaves in bf16 (training/float8.py,
    converts), less srelu24's W1 and W2 in its 2:4 phase (its op takes them)."""
    from .float8 import converts

    key = ("unconverted", repr(mcfg), repr(fcfg), vocab, sparse_2to4)
    if key not in _COUNTS:
        block = _meta_model(replace(mcfg, n_layers=1), fcfg, vocab).layers[0]
        op = {id(block.feed_forward.w1.weight), id(block.feed_forward.w2.weight)} if sparse_2to4 else set()
        _COUNTS[key] = sum(m.weight.numel() for name, m in block.named_modules()
                           if isinstance(m, torch.nn.Linear) and not converts(m, name) and id(m.weight) not in op)
    return _COUNTS[key]


def _meta_model(mcfg: ModelConfig, fcfg: FFNConfig, vocab: int) -> Transformer:
    with torch.device("meta"):
        return Transformer(mcfg, fcfg, vocab)


def op_keeps_x_in_e4m3(fcfg: FFNConfig, float8: Float8, tokens: int, hidden: int) -> bool:
    """Whether srelu24's 2:4 op keeps X's e4m3 cast for dW1 rather than X (srelu24_kernels/srelu24/op.py,
    _pairs_token_casts; an sm90 GPU assumed, as for A24)."""
    return (float8 == Float8.tensorwise and fcfg.sparse_float8 and fcfg.kernels
            and tokens % 64 == 0 and hidden % 64 == 0)


def block_activation_bytes(mcfg: ModelConfig, fcfg: FFNConfig, sparse_2to4: bool, residual_bytes: int,
                           act_bytes: int, float8: Float8 = Float8.none, compiled: bool = False,
                           statistics: bool = True, tokens: int = 0) -> float:
    """Bytes per token that one block keeps for its backward (the module docstring) with `tokens` a
    micro-batch. statistics: a step that collects the FFN statistics, which keeps more under
    compiled float8 (a dense FFN's statistics split its block); the peak of a run without CUDA
    graphs is such a step."""
    d = mcfg.dim
    d_kv = (mcfg.n_kv_heads or mcfg.n_heads) * (d // mcfg.n_heads)
    h = ffn_hidden_dim(mcfg, fcfg)
    kind = fcfg.kind
    sparse = kind == "srelu24" and sparse_2to4
    float8_compiled = compiled and float8 != Float8.none
    kept = FFN_KEPT_FLOAT8 if float8_compiled else FFN_KEPT
    if sparse:
        ffn = A24_OF_Z * act_bytes * h
    else:
        # a variant not listed is counted as swiglu, which keeps the most
        ffn = kept.get("srelu" if kind == "srelu24" else kind, kept["swiglu"]) * act_bytes * h
    if not float8_compiled:
        normalised = 2 * act_bytes * d
    else:  # the FFN input's e4m3 cast (srelu24's op: X where it makes no cast)
        normalised = (act_bytes if sparse and not op_keeps_x_in_e4m3(fcfg, float8, tokens, h) else 1) * d
        if sparse or statistics:
            # the attention output's e4m3 cast is kept, not remade, where the FFN is opaque to the
            # partitioner (srelu24's op) or split off (a dense FFN's statistics)
            normalised += d
        if statistics and not sparse:  # and on the split's far side, A's (swiglu: the product's) cast
            ffn += h
    # residual stream in and after attention; their normalised copies; q, o and k, v
    return 2 * residual_bytes * d + normalised + act_bytes * (2 * d + 2 * d_kv) + ffn


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

    P, P_block, P_root = _counts(mcfg, fcfg, vocab)
    L, d, T = mcfg.n_layers, mcfg.dim, t.micro_batch_size * t.seq_len
    n_ckpt = {ActivationCheckpointing.none: 0, ActivationCheckpointing.selective: math.ceil(L / 2),
              ActivationCheckpointing.full: L}[t.activation_checkpointing]

    def per_block(statistics: bool = True) -> float:
        return block_activation_bytes(mcfg, fcfg, sparse_2to4, residual, act, t.float8, t.compile, statistics, T) * T

    e = MemoryEstimate()
    e.parts["parameters (fp32)"] = 4 * P // shard
    e.parts["optimizer state (AdamW, fp32)"] = 8 * P // shard
    e.parts["gradients (fp32)"] = 4 * P // shard
    if ddp:
        e.parts["DDP gradient buckets"] = 4 * P
    if fsdp:
        e.parts["FSDP all-gathered bf16 weights"] = (2 if bf16 else 4) * (P_root + 2 * P_block)
    # a checkpointed block's recomputation: eager in a step with statistics (training/distributed.py,
    # checkpointed), where a float8 block keeps the uncompiled rows, which are the larger
    recomputed = block_activation_bytes(mcfg, fcfg, sparse_2to4, residual, act, tokens=T) * T

    def activations(statistics: bool = True) -> int:
        return int((L - n_ckpt) * per_block(statistics) + n_ckpt * residual * d * T)

    e.parts["activations"] = activations()

    kept_grads = grad_accumulation or t.cuda_graph  # .grad exists before the backward (added into)
    out_grad = 0 if kept_grads else 4 * vocab * d // shard  # else: already in the gradients
    head = 2 * act * T * vocab + out_grad
    block = (out_grad + (0 if kept_grads else 4 * P_block // shard) + BLOCK_GRAD_TRANSIENT_BYTES * P_block
             + RESIDUAL_BACKWARD_BYTES_PER_D * (act // 2) * d * T + (recomputed if n_ckpt else 0))
    e.transient = "loss head backward" if head >= block else "block backward"
    e.parts[f"largest transient ({e.transient})"] = int(max(head, block))
    if grad_accumulation and bf16 and not fsdp:
        # autocast's bf16 copy of every block's linear weights lives from the forward into the
        # backward; srelu24's op takes W1, W2 itself in its 2:4 phase. Measured at full depth under
        # accumulation (7B, 32 layers, one H200: 8-12 GiB above the estimate without it); the
        # no-accumulation benchmark points were calibrated without it (their constants absorb it).
        # Under float8 only the linears it leaves in bf16 have one: the others cast fp32 to e4m3
        ffn_weights = 2 * d * ffn_hidden_dim(mcfg, fcfg) if sparse_2to4 else 0
        copied = (P_block - 2 * d - ffn_weights if t.float8 == Float8.none
                  else _unconverted_block_weights(mcfg, fcfg, vocab, sparse_2to4))
        if copied:
            e.parts[WEIGHT_COPIES] = 2 * L * copied
    e4m3_op = sparse_2to4 and not fsdp and t.float8 != Float8.none and fcfg.sparse_float8
    if e4m3_op and keeps_conversions(grad_accumulation, t.float8):
        # W1's rows and columns, W2's rows and columns: 4 per layer of d x F bytes (e4m3)
        e.parts[KEPT_CONVERSIONS] = 4 * d * ffn_hidden_dim(mcfg, fcfg) * L
    if sparse_2to4 and pairs_grad_unscaling(mcfg, fcfg, t, grad_accumulation):
        # one micro-batch's dW1 and dW2 products in bf16, waiting for the next (model/ffn.py, begin_step)
        e.parts[PAIRED_PRODUCTS] = 2 * 2 * d * ffn_hidden_dim(mcfg, fcfg) * L

    if t.cuda_graph:
        # training/cuda_graph.py: the graph's private pool keeps what a micro-batch without statistics
        # allocates, and an eager micro-batch (the capture's warmup, a step with FFN statistics) takes its
        # own beside it; .grad is allocated for the whole run
        e.parts[GRAPH_POOL] = activations(statistics=False) + int(max(head, block)) + e.parts.get(WEIGHT_COPIES, 0)
    # what lives from the forward into the backward only (not through the optimizer step)
    backward_only = (KEPT_CONVERSIONS, PAIRED_PRODUCTS, WEIGHT_COPIES, GRAPH_POOL)
    resident = sum(v for k, v in e.parts.items()
                   if k not in ("gradients (fp32)", "activations", *backward_only)
                   and not k.startswith("largest transient"))
    backward = resident + e.parts["activations"] + max(head, block) + (e.parts["gradients (fp32)"]
                                                                        if kept_grads else 0)
    backward += sum(e.parts.get(k, 0) for k in backward_only)
    step = resident + e.parts["gradients (fp32)"]
    e.peak, e.peak_phase = (int(backward), "backward") if backward >= step else (int(step), "optimizer step")
    return e


def world_size_of_launch(t: TrainerConfig) -> int:
    """The world size torchrun or SLURM launched (1 without one)."""
    from .distributed import launch_env

    launch = launch_env(slurm=t.strategy != Strategy.none)
    return launch.world_size if launch else 1


def use_bf16(precision: str, device: torch.device) -> bool:
    """trainer.precision on this device: auto is bf16 on CUDA, fp32 on the CPU."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def run_phases(cfg: Config) -> list[Optional[bool]]:
    """estimate's sparse_2to4 for each phase the run goes through: srelu24's dense warmup and its 2:4
    phase, or the one phase of a dense FFN."""
    if cfg.ffn.kind != "srelu24":
        return [None]
    warmup = cfg.ffn.dense_warmup_steps
    return [False] * (warmup > 0) + [True] * (warmup < total_steps(cfg.trainer)) or [False]


def phase_name(sparse_2to4: Optional[bool]) -> str:
    """estimate's sparse_2to4 as the phase it stands for ("" for a dense FFN's one phase)."""
    return "" if sparse_2to4 is None else "srelu24 2:4" if sparse_2to4 else "srelu24 dense warmup"


def run_peak(cfg: Config, vocab: int, t: TrainerConfig, world: int, bf16: bool) -> tuple[int, str]:
    """The largest peak per GPU over the run's phases, and the phase's name ("" for a dense FFN)."""
    return max((estimate(cfg.model, cfg.ffn, vocab, t, world, sparse_2to4=s, bf16=bf16).peak, phase_name(s))
               for s in run_phases(cfg))


@dataclass(frozen=True)
class Change:
    """Settings that change the peak: `overrides` for the command line, on `world` processes."""
    overrides: tuple
    world: int
    cost: float    # the step's extra time, roughly, as a fraction (see _knob_cost)
    peak: int = 0

    def __str__(self) -> str:
        gpus = f" under torchrun --nproc-per-node={self.world}" if self.world > 1 else ""
        return f"{' '.join(self.overrides)}{gpus} ({gib(self.peak)})"


# A micro-batch of at least this many tokens keeps the GEMMs long enough that splitting the batch
# further costs little: the same FLOPs, only more (and shorter) launches per step.
LONG_MICRO_BATCH_TOKENS = 4096


def _knob_cost(key: str, value, t: TrainerConfig) -> float:
    """The order in which changes are offered, cheapest first: a smaller micro-batch of long
    sequences computes the same FLOPs; checkpointing recomputes forwards (the forward is about a
    third of a step: selective recomputes half the blocks, full all); a short micro-batch we rank
    with full checkpointing; FSDP where the run had DDP moves the same bytes differently."""
    if key == "trainer.micro_batch_size":  # and a little per halving: of two that fit, the larger micro-batch
        return (value * t.seq_len < LONG_MICRO_BATCH_TOKENS) / 3 + 0.01 * math.log2(t.micro_batch_size / value)
    if key == "trainer.activation_checkpointing":
        return {"selective": 1 / 6, "full": 1 / 3}[value]
    return 1 / 6  # trainer.strategy=fsdp


def _candidates(t: TrainerConfig, world: int, more_gpus: bool) -> list[tuple[dict, int]]:
    """({key: value}, world size) of the settings the search tries: smaller micro-batches (halvings
    that keep batch_size divisible), more activation checkpointing, each alone and combined, then
    FSDP on 2, 4 and 8 times the GPUs (and FSDP on these GPUs where the run has DDP)."""
    order = list(ActivationCheckpointing)
    acs = [None] + [a.value for a in order[order.index(t.activation_checkpointing) + 1:]]
    micros = [None] + sorted({t.micro_batch_size // 2 ** k for k in range(1, t.micro_batch_size.bit_length())
                              if t.micro_batch_size % 2 ** k == 0} | ({1} if t.micro_batch_size > 1 else set()),
                             reverse=True)
    knobs = [{k: v for k, v in (("trainer.micro_batch_size", m), ("trainer.activation_checkpointing", a))
              if v is not None} for m in micros for a in acs]
    out = [(k, world) for k in knobs if k]
    worlds = ([world] if world > 1 and t.strategy != Strategy.fsdp else []) + \
        ([w * world for w in (2, 4, 8)] if more_gpus else [])
    for w in worlds:
        out += [({"trainer.strategy": "fsdp", **k}, w) for k in knobs if "trainer.micro_batch_size" not in k]
    return out


def fitting_changes(cfg: Config, vocab: int, world: int, bf16: bool, limit: int, more_gpus: bool) -> list[Change]:
    """The changes of _candidates whose peak (estimate, over the run's phases) is at most `limit`
    bytes, cheapest first: those on the same GPUs before those that need more, then fewer knobs,
    then the smaller _knob_cost, then the lower peak. A change that includes a fitting one with
    fewer knobs is left out (it only costs more)."""
    t, fits = cfg.trainer, []
    for knobs, w in _candidates(t, world, more_gpus):
        values = {"trainer.micro_batch_size": t.micro_batch_size, "trainer.strategy": t.strategy.value,
                  "trainer.activation_checkpointing": t.activation_checkpointing.value, **knobs}
        if t.batch_size % (values["trainer.micro_batch_size"] * w):
            continue
        tc = replace(t, micro_batch_size=values["trainer.micro_batch_size"], strategy=Strategy(values["trainer.strategy"]),
                     activation_checkpointing=ActivationCheckpointing(values["trainer.activation_checkpointing"]))
        peak, _ = run_peak(cfg, vocab, tc, w, bf16)
        if peak <= limit:
            cost = sum(_knob_cost(k, v, t) for k, v in knobs.items())
            fits.append(Change(tuple(f"{k}={v}" for k, v in knobs.items()), w, cost, peak))
    fits.sort(key=lambda c: (c.world > world, c.world, len(c.overrides), c.cost, c.peak))
    return [c for c in fits if not any(set(o.overrides) < set(c.overrides) and o.world <= c.world for o in fits)]


def resident_bytes(cfg: Config, vocab: int, t: TrainerConfig, world: int) -> int:
    """Parameters, gradients and AdamW's state per GPU: what no micro-batch or checkpointing lowers."""
    e = estimate(cfg.model, cfg.ffn, vocab, t, world)
    return sum(e.parts[k] for k in ("parameters (fp32)", "optimizer state (AdamW, fp32)", "gradients (fp32)"))


def dry_run_rows(cfg: Config, vocab: int, bf16: Optional[bool] = None) -> list[tuple[str, str]]:
    """The dry run's memory rows: peak per GPU with its breakdown (srelu24: its dense warmup and its
    2:4 phase), one checkpoint's bytes and the free disk its checkpoints need."""
    t = cfg.trainer
    world = world_size_of_launch(t)
    # both of srelu24's phases, whatever the run's warmup: the breakdown shows what 2:4 changes
    phases = [(f" ({phase_name(s)})", s) for s in (False, True)] if cfg.ffn.kind == "srelu24" else [("", None)]
    setup = (f"{world} GPU(s), strategy {t.strategy.value}, activation checkpointing "
             f"{t.activation_checkpointing.value}, micro-batch {t.micro_batch_size} x {t.seq_len}")
    rows, first = [("memory per GPU, estimated for", setup)], None
    for name, sparse in phases:
        e = estimate(cfg.model, cfg.ffn, vocab, t, world, sparse_2to4=sparse, bf16=bf16)
        rows.append((f"  peak{name}", f"{e.peak / GiB:.1f} GiB (at the {e.peak_phase})"))
        # a second phase: only what differs from the first
        rows += [(f"    {k}", f"{v / GiB:.2f} GiB") for k, v in e.parts.items() if first is None or first.get(k) != v]
        first = first or e.parts
    size = checkpoint_bytes(_meta_model(cfg.model, cfg.ffn, vocab), "adamw", world)  # the one definition
    disk = space_needed(size, saves_ahead(0, total_steps(t), t.ckpt_every, t.stop_at_step), 0, t.keep_last)
    rows.append(("checkpoint size (weights + AdamW)", f"{size / 1e9:.3g} GB"))
    copies = "every save" if t.keep_last == 0 else f"trainer.keep_last={t.keep_last} plus the one being written"
    rows.append(("disk for checkpoints", f"{disk / 1e9:.3g} GB free ({copies})"))
    return rows
