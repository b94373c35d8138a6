"""One optimizer step, top to bottom: the function the trainer's loop calls and
scripts/bench_step.py times, so that the benchmark measures what training runs.

    sparsity switch -> LR -> micro-batches (forward, backward, gradient accumulation, inside
    srelu24's step state) -> clip -> non-finite check -> AdamW (-> float8 scales) -> statistics
    (logged steps only)

srelu24's step state (model/ffn.py, `srelu24_step`): under gradient accumulation (and under the
tensorwise recipe with one micro-batch: `conversions_kept`) its e4m3 weight conversions are made
once when the step begins and reused by every micro-batch, and under accumulation its op adds the
weight gradients into .grad itself from the second micro-batch on (the first's become .grad as
autograd assigns them: no zero fill); both end with the micro-batches, before the optimizer writes
the weights.

trainer.cuda_graph (training/cuda_graph.py): each micro-batch's forward and backward is one replay
of a CUDA graph that reads fixed buffers; it keeps srelu24's step state itself, and the .grad
buffers it adds into are zeroed in place after the optimizer, not dropped.

The non-finite check: one process, nonfinite=skip and a fused Adam/AdamW skip on the device (the
optimizer's found_inf), with no host sync; the count of skipped steps is read back on logged steps
and by `TrainState.settle_skipped`. Otherwise (several ranks must agree, nonfinite=stop names
the tensor, an unfused optimizer) the norm is read back every step and the step skipped on the host.
"""
import logging
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from model.ffn import conversions_kept, srelu24_step

from .distributed import Dist, agree, clip_grad_norm, local, sum_over_ranks
from .errors import TrainingError
from .float8 import float8_after_optimizer_step


@dataclass
class TrainState:
    """What the loop carries from one step to the next, and a checkpoint keeps: the counters
    (saved in train_state.json) and this rank's loader (its position: saved per rank)."""
    step: int = 0             # optimizer steps done
    tokens: int = 0           # tokens trained on, all ranks together
    skipped_steps: int = 0    # steps whose gradients were non-finite and were not applied
    elapsed_s: float = 0.0    # training wall-clock time, carried over resumes
    loader: Any = field(default=None, repr=False, compare=False)  # the TokenLoader (state_dict / load_state_dict)
    # skipped on the device and not yet in skipped_steps (a 0-dim tensor), counted from step pending_from
    pending_skips: Optional[Tensor] = field(default=None, repr=False, compare=False)
    pending_from: int = field(default=0, repr=False, compare=False)

    def counters(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("loader", "pending_skips", "pending_from")}

    def settle_skipped(self) -> None:
        """Add the steps skipped on the device to skipped_steps (a host sync), with one warning for
        them. Logged steps do it; the loop calls it where it needs the exact count (checkpoints)."""
        if self.pending_skips is None:
            return
        n, first = int(self.pending_skips.item()), self.pending_from
        self.pending_skips = None
        if n:
            self.skipped_steps += n
            warn_skipped(first, self.step, n, self.skipped_steps)


@dataclass
class StepParts:
    """Everything a step needs that does not change from one step to the next."""
    model: nn.Module          # parameter names never change (checkpoints, statistics)
    train_module: nn.Module   # what the forward calls: DDP's wrapper, or the model
    optimizer: torch.optim.Optimizer
    dist: Dist
    accum: int                                   # micro-batches per step and rank
    tokens_per_step: int                         # all ranks
    lr_at: Callable[[int], float]                # the schedule: step -> LR
    grad_clip: float = 0.0                       # 0: no clipping (the norm is still computed)
    sparse_from: Optional[int] = None            # srelu24: first step of the 2:4 phase; None: never
    autocast: Callable[[], ContextManager] = nullcontext
    nonfinite: str = "skip"                      # skip the step, or "stop" the run
    params: list = field(default_factory=list)   # filled from the model when empty
    # trainer.cuda_graph: the micro-batches through fixed buffers, replayed from a CUDA graph
    # (training/cuda_graph.py, MicroBatchGraphs); None: eager
    graphs: Any = None

    def __post_init__(self):
        if not self.params:
            self.params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def skip_on_device(self) -> bool:
        """The optimizer can skip a non-finite step itself, and no other rank needs telling."""
        o = self.optimizer
        return (self.dist.world_size == 1 and self.nonfinite == "skip" and isinstance(o, torch.optim.Adam)
                and all(g["fused"] and not g["differentiable"] for g in o.param_groups))


@dataclass
class StepResult:
    lr: float
    sparse_on: bool
    applied: Optional[bool]       # False: non-finite gradients, the step was skipped; None: not known
                                  # (skipped on the device, a step that is not logged)
    stop: bool                    # some rank asked to stop (a signal): checkpoint and leave
    data_s: float                 # host time spent getting batches
    loss: Optional[float] = None  # logged steps: mean over micro-batches and ranks
    grad_norm: Optional[float] = None
    stats: Optional[Tensor] = None  # steps with statistics: FFN statistics summed over ranks (srelu24_kernels/ffn_stats.py derive)


def train_step(p: StepParts, state: TrainState, next_batch: Callable[[], tuple[Tensor, Tensor]], *,
               log: bool = False, stats: Optional[bool] = None, stop_requested: Callable[[], bool] = lambda: False,
               mark: Optional[Callable[[str], None]] = None) -> StepResult:
    """One optimizer step from `state.step`; advances `state`. `next_batch` gives this rank's
    (x, y) micro-batch on the device. `log`: read the loss and gradient norm back (the only host
    syncs besides the non-finite check, which has none when `p.skip_on_device`); `stats`: also
    collect the FFN statistics (default: as `log`; only on a logged step).
    `mark(phase)` is called after each phase ("optimizer" for the step state's opening, then
    "data", "forward", "backward" per micro-batch, then "optimizer"), for the benchmark.
    `stop_requested()` is asked after the backward (a signal that came during the step still stops
    after it), with several ranks in the same all-reduce as the non-finite check."""
    mark = mark or (lambda phase: None)
    model, d, step = p.model, p.dist, state.step
    sparse_on = p.sparse_from is not None and step >= p.sparse_from
    model.set_2to4(sparse_on)
    stats = log if stats is None else stats and log
    model.collect_ffn_stats(stats)  # statistics of these steps only: free on the others
    lr = p.lr_at(step)
    for group in p.optimizer.param_groups:
        group["lr"] = lr

    loss_sum, data_s = torch.zeros((), device=d.device), 0.0
    with micro_batch_state(p, sparse_on, stats) as micro_batches:
        mark("optimizer")  # srelu24's weight conversions for the step: the optimizer's work, not data's
        for micro in range(p.accum):
            t0 = time.perf_counter()
            x, y = next_batch()
            data_s += time.perf_counter() - t0
            mark("data")
            if p.graphs is not None:  # forward and backward in one replay: its time is the forward's
                loss_sum += p.graphs.micro(x, y)
                mark("forward")
                mark("backward")
                continue
            with grad_sync(p.train_module, last=micro == p.accum - 1):
                with p.autocast():
                    loss = p.train_module(x, y)
                mark("forward")
                (loss / p.accum).backward()  # DDP / FSDP average the gradients over ranks
                mark("backward")
            if micro_batches is not None:  # srelu24's paired weight gradients: which of a pair is next
                micro_batches.advance()
            loss_sum += loss.detach()

    grad_norm = clip_grad_norm(p.params, p.grad_clip if p.grad_clip > 0 else math.inf)  # global over ranks
    if p.skip_on_device:
        optimizer_step_skipping_on_device(p, state, grad_norm)
        applied, stop = None, stop_requested()
    else:
        # one small all-reduce per step, so that every rank skips (or stops) together; it reads the
        # gradient norm back: a host sync per step, before the optimizer
        nonfinite, stop = agree([not torch.isfinite(grad_norm).item(), stop_requested()], d)
        applied = not nonfinite
        if not nonfinite:  # a NaN never reaches the weights
            p.optimizer.step()
            float8_after_optimizer_step(model)  # FSDP2 + tensorwise float8: the next all-gathers' scales
        elif p.nonfinite == "stop":
            raise TrainingError(nonfinite_report(step + 1, loss_sum / p.accum, model))
        else:
            state.skipped_steps += 1
            if d.is_main:
                warn_skipped(step + 1, step + 1, 1, state.skipped_steps)
    p.optimizer.zero_grad(set_to_none=p.graphs is None)  # a graph adds into the same .grad every step
    mark("optimizer")
    state.step += 1
    state.tokens += p.tokens_per_step

    out = StepResult(lr=lr, sparse_on=sparse_on, applied=applied, stop=stop, data_s=data_s)
    if log:
        out.loss = (sum_over_ranks(loss_sum / p.accum, d) / d.world_size).item()
        out.grad_norm = grad_norm.item()
        if stats:
            model.collect_ffn_stats(False)
            out.stats = sum_over_ranks(model.pop_ffn_stats(), d).cpu()
        if out.applied is None:
            out.applied = math.isfinite(out.grad_norm)
            state.settle_skipped()
    return out


@contextmanager
def micro_batch_state(p: StepParts, sparse_on: bool, stats: bool):
    """What a step's micro-batches share, opened before the first and closed after the last, also on
    errors: srelu24's step state (model/ffn.py), or under trainer.cuda_graph the graph's buffers,
    which keep it."""
    if p.graphs is not None:
        p.graphs.begin_step(sparse_on, stats)
        try:
            yield
        finally:
            p.graphs.end_step()
        return
    # one micro-batch shares only tensorwise's conversions (conversions_kept). FSDP2 gathers its weights
    # anew for each use; DDP's reducer hooks autograd's accumulation into .grad, which srelu24's op would bypass
    several, fsdp = p.accum > 1, is_fsdp(p.model)
    with srelu24_step(p.model, keep_conversions=conversions_kept(p.model, several) and not fsdp,
                      grads_in_place=several and not fsdp and p.train_module is p.model) as micro_batches:
        yield micro_batches


def optimizer_step_skipping_on_device(p: StepParts, state: TrainState, grad_norm: Tensor) -> None:
    """Fused AdamW skips the update (and keeps its step count) where found_inf is 1: the host never
    waits for the norm, and the count of skipped steps stays on the device until it is read anyway."""
    found_inf = torch.isfinite(grad_norm).logical_not().to(torch.float32)
    p.optimizer.found_inf = found_inf
    try:
        p.optimizer.step()
    finally:
        del p.optimizer.found_inf
    float8_after_optimizer_step(p.model)  # weights unchanged on a skip: the same scales
    if state.pending_skips is None:
        state.pending_skips, state.pending_from = torch.zeros((), device=found_inf.device), state.step + 1
    state.pending_skips += found_inf


def warn_skipped(first: int, last: int, n: int, total: int) -> None:
    """The warning for n non-finite steps skipped in steps first..last (1-based)."""
    if first == last:
        msg = f"step {first}: non-finite gradient, step skipped ({total} so far)"
    else:
        msg = f"steps {first}-{last}: {n} non-finite gradient step{'s' if n > 1 else ''} skipped ({total} so far)"
    logging.getLogger(__name__).warning(msg)


def is_fsdp(model: nn.Module) -> bool:
    """FSDP2-sharded (fully_shard): its gathered weights come and go within a micro-batch."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_sync(train_module: nn.Module, last: bool):
    """DDP all-reduces on the last micro-batch only; FSDP reduce-scatters each one (its sharded
    gradients accumulate, so memory stays sharded)."""
    if last or not hasattr(train_module, "no_sync"):
        return nullcontext()
    return train_module.no_sync()


def nonfinite_report(step: int, loss: Tensor, model: nn.Module) -> str:
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(local(p.grad)).all()]
    return (f"step {step}: non-finite gradient (loss {loss.item():.4g}) first in {bad[0] if bad else '?'} "
            f"({len(bad)} tensor(s)); trainer.nonfinite=stop, nothing was checkpointed after the last good step")
