"""trainer.cuda_graph: each micro-batch's forward and backward replayed from a CUDA graph, captured
by hand with torch.cuda.graph, so that the host launches one graph where it launched every kernel.
A step that waits on the host (srelu24 in float8 at 1B: benchmarks/RESULTS.md, "A micro-batch as
one CUDA graph") then runs at the GPU's pace; one that does not gains nothing and loses nothing.

A capture bakes in every address its kernels read, so everything a micro-batch reads or writes
lives in a fixed buffer:
- the tokens and targets, copied into fixed buffers before each replay;
- srelu24's token orders: drawn on the host for each micro-batch by the same call, from the same
  generator, as the eager model draws them (model/transformer.py, Transformer.token_orders), and
  copied into a fixed buffer that the model reads instead. A graphed run therefore trains bit for
  bit as the eager one (tests/test_cuda_graph.py);
- the gradients: every parameter's .grad is allocated once and zeroed in place after each
  optimizer step (training/step.py), and each replay adds into it, as autograd and srelu24's op
  (which adds its weight gradients into it itself) do (a .grad replaced between steps gets a new
  capture, and srelu24's step states are opened anew on it);
- srelu24's step state (model/ffn.py, begin_step): opened once per 2:4 phase and kept; at each
  step its weights' e4m3 conversions are made afresh, written into the buffers the graph reads
  (under tensorwise; copied there under rowwise).
- srelu24's paired weight gradients (ffn.paired_grad_unscaling, several micro-batches): a pair's
  first micro-batch keeps its products in the step state's buffers and its second adds both into
  .grad, so they are two graphs, captured together and replayed in turn (first, second, first,
  ...), sharing one pool: their replays never overlap. A step that ends on a pair's first adds its
  kept products after the last replay (end_step).

One graph per 2:4 phase, or one per half of a pair (srelu24's dense warmup has its own, dropped at
the switch). Steps that collect the FFN statistics (every logged step, or every
trainer.ffn_stats_every steps) run the same micro-batch eagerly: the statistics are other kernels,
some of which copy from the host; other logged steps replay and read the graph's loss. The graphs
are captured on a step's first micro-batch, each after two eager runs of it on a side stream
(compilation, cuSPARSELt's plans and id search, cuBLAS workspaces) whose gradients are zeroed.
Hand-made rather than torch.compile's mode="reduce-overhead": its cudagraph trees hand a graph's
output buffers to the next replay, which broke gradient accumulation (lab/LOG.md).

Memory: the graph's pool (one for a pair's two) keeps one micro-batch's activations for its life, and the
eager runs (warmup, steps with statistics) allocate theirs beside it: up to one micro-batch's
activations more than an eager run. Where it runs: one process, no activation checkpointing, causal attention,
a CUDA device (`graph_problem`). On a CPU the "graph" runs the micro-batch eagerly through the
same buffers: the tests check the bookkeeping there, and the capture on a GPU.
"""
import logging
from typing import Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from model.ffn import SReLU24, add_trailing_kept, conversions_kept
from srelu24_kernels.srelu24.options import MicroBatches
from srelu24_kernels.srelu24.reference import random_token_orders

log = logging.getLogger(__name__)
WARMUP_RUNS = 2  # eager runs before a capture: the first compiles and searches, the second runs as it will


def graph_problem(cuda_graph: bool, world_size: int, strategy: str, activation_checkpointing: str,
                  attention: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why trainer.cuda_graph=true cannot run with these settings, in one line; None if it can.
    device: the resolved device, where known."""
    if not cuda_graph:
        return None
    why = []
    if world_size > 1 or strategy != "none":
        why.append(f"one process and trainer.strategy=none (got {world_size} process(es), strategy={strategy}: "
                   "DDP's and FSDP2's collectives and hooks are not captured)")
    if activation_checkpointing != "none":
        why.append(f"trainer.activation_checkpointing=none (got {activation_checkpointing}: recomputation reads the "
                   "RNG state on the host)")
    if attention != "causal":
        why.append(f"model.attention=causal (got {attention}: the document mask is not captured)")
    if device is not None and device.type != "cuda":
        why.append(f"a CUDA device (got {device})")
    if why:
        return "trainer.cuda_graph=true needs " + "; ".join(why) + "; or set trainer.cuda_graph=false"
    return None


class _OrderFeed:
    """The model's token orders read from one fixed buffer (the instance attribute shadows
    Transformer.token_orders); `draw` fills it as the eager model would draw them."""

    def __init__(self, model: nn.Module, T: int, device: torch.device):
        self.model, self.T, self.device = model, T, device
        self.wants: list[bool] = []
        self.buf: Optional[Tensor] = None

    def set_phase(self) -> None:
        """The FFNs that want an order now (srelu24's 2:4 phase with token_permutation); a fixed
        buffer of identity orders for them, until `draw` fills it."""
        self.wants = [layer.feed_forward.wants_token_order() for layer in self.model.layers]
        n = sum(self.wants)
        if n:
            ar = torch.arange(self.T, dtype=torch.int32, device=self.device)
            self.buf = ar.expand(n, 2, self.T).contiguous()  # [i, 0] an order, [i, 1] its inverse
        else:
            self.buf = None

    def draw(self) -> None:
        if self.buf is not None:
            self.buf.copy_(random_token_orders(self.T, self.buf.shape[0], self.device), non_blocking=True)

    def __call__(self, T: int, device) -> Optional[list]:
        if self.buf is None or not torch.is_grad_enabled():
            return None
        if T != self.T:
            raise ValueError(f"trainer.cuda_graph: a forward of {T} tokens in a run whose micro-batches hold {self.T}")
        rows = iter(self.buf.unbind(0))
        return [next(rows) if w else None for w in self.wants]


class MicroBatchGraphs:
    """A step's micro-batches through fixed buffers, replayed from a CUDA graph (module docstring).
    training/step.py calls begin_step, then micro for each micro-batch, then end_step."""

    def __init__(self, model: nn.Module, train_module: nn.Module, params: list, accum: int,
                 autocast: Callable[[], ContextManager], micro_batch: int, seq_len: int, device: torch.device):
        self.model, self.train_module, self.params, self.accum, self.autocast = model, train_module, params, accum, autocast
        self.device, self.capture = device, device.type == "cuda"
        self.x = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        self.y = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        self.feed = _OrderFeed(model, micro_batch * seq_len, device)
        self.ffns = [m for m in model.modules() if isinstance(m, SReLU24)]
        self.phase: Optional[bool] = None   # the 2:4 phase the graph and the step states are for
        self.states: list = []              # srelu24's kept step states, one per FFN (None where it has none)
        # srelu24's paired weight gradients: where a step is in its pairs (None: no FFN pairs)
        self.micro_batches: Optional[MicroBatches] = None
        # the captured graphs and their outputs (the loss), by the half of a pair they run (`_half`)
        self.graphs: dict[bool, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.loss: Optional[Tensor] = None  # the output of the graph replayed last
        self.grads: list = []               # the .grad tensors the graph adds into
        self.eager = True                   # this step runs eagerly (one with FFN statistics)
        self.index = 0                      # the step's micro-batches so far
        self.replays = 0                    # micro-batches replayed from the graph, all steps

    @classmethod
    def for_step(cls, parts, micro_batch: int, seq_len: int) -> "MicroBatchGraphs":
        """For a training/step.py StepParts whose micro-batches are [micro_batch, seq_len] tokens."""
        return cls(parts.model, parts.train_module, parts.params, parts.accum, parts.autocast, micro_batch, seq_len,
                   parts.dist.device)

    # ------------------------------------------------------------ a step
    def begin_step(self, sparse_on: bool, stats: bool) -> None:
        """Before a step's first micro-batch (after model.set_2to4 and collect_ffn_stats)."""
        if sparse_on != self.phase:  # the first step, or srelu24's switch to 2:4: a new graph
            self.graphs, self.loss, self.phase = {}, None, sparse_on
            self.states = []
            self.feed.set_phase()
            self.model.token_orders = self.feed
            if self.capture:
                torch.cuda.empty_cache()  # the dropped graph's pool
        for p in self.params:
            if p.grad is None:  # once: the buffers every replay adds into, zeroed in place after each step
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if self.graphs and any(p.grad is not g for p, g in zip(self.params, self.grads)):
            self.graphs, self.loss = {}, None  # .grad was replaced (set to None, reassigned): capture anew
        if self.states and not self._states_hold_grads():
            self.states, self.graphs, self.loss = [], {}, None  # srelu24's op would add into the old .grad
        if not self.states:
            self.states = self._open_states()
        else:
            self._refresh_conversions()
        for m, st in zip(self.ffns, self.states):
            m.step_state = st
        if self.micro_batches is not None:
            self.micro_batches.reset()
        self.eager, self.index = stats or not self.capture, 0

    def micro(self, x: Tensor, y: Tensor) -> Tensor:
        """One micro-batch's forward and backward; its loss (detached)."""
        if x.shape != self.x.shape or y.shape != self.y.shape:
            raise ValueError(f"trainer.cuda_graph: a micro-batch of {tuple(x.shape)} tokens where the graph holds "
                             f"{tuple(self.x.shape)}")
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.feed.draw()
        first, self.index = self.index == 0, self.index + 1
        if self.eager:
            loss = self._run()
        else:
            if not self.graphs:
                if not first:  # the warmup's gradients would land in this step's
                    raise RuntimeError("trainer.cuda_graph: a capture must come on a step's first micro-batch")
                self._capture()
            graph, self.loss = self.graphs[self._half()]
            graph.replay()
            self.replays += 1
            loss = self.loss
        if self.micro_batches is not None:
            self.micro_batches.advance()
        return loss

    def end_step(self) -> None:
        """After the step's last micro-batch, before the optimizer writes the weights: a pair's first
        left without its second adds its kept products into .grad; the kept step states leave the
        FFNs (an evaluation reads the new weights, not the conversions)."""
        if self.micro_batches is not None:
            for st in self.states:
                add_trailing_kept(st)
            self.micro_batches.reset()  # added: a second end_step (close) adds nothing
        for m in self.ffns:
            m.step_state = None

    def close(self) -> None:
        """The graphs and their buffers released; the model draws its own token orders again."""
        self.end_step()
        self.graphs, self.loss, self.states, self.phase = {}, None, [], None
        if self.model.__dict__.get("token_orders") is self.feed:
            del self.model.token_orders
        if self.capture:
            torch.cuda.empty_cache()  # the graph's private pool, which no later allocation reuses

    # ------------------------------------------------------------ inside
    def _run(self) -> Tensor:
        with self.autocast():
            loss = self.train_module(self.x, self.y)
        (loss / self.accum).backward()
        return loss.detach()

    def _half(self) -> bool:
        """Which graph runs this micro-batch: a pair's first (True) or its second; True without pairs."""
        return self.micro_batches is None or self.micro_batches.keep

    def _capture(self) -> None:
        """The graph of each half of a pair (one without pairs), each after WARMUP_RUNS eager runs of
        it; the warmups' gradients (and kept products) zeroed or overwritten before the first replay."""
        halves = (True, False) if self.micro_batches is not None else (True,)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                for half in halves:  # a pair's second reads what its first kept
                    self._as_half(half)
                    self._run()
        torch.cuda.current_stream().wait_stream(side)
        torch._foreach_zero_([p.grad for p in self.params])
        pool, graphs = None, {}
        for half in halves:
            self._as_half(half)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls (a background checkpoint's writer, which can be
            # writing the step before srelu24's switch) neither fail nor invalidate the capture.
            # pool: the second half's graph reuses the first's memory (they run one after the other)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                loss = self._run()
            pool = graph.pool()
            graphs[half] = (graph, loss)
        self._as_half(True)
        # kept only once every half is captured: a failed second capture leaves none, not half a pair
        self.graphs, self.grads = graphs, [p.grad for p in self.params]
        what = "2:4 phase" if self.phase and self.ffns else "dense"
        log.info(f"trainer.cuda_graph: a micro-batch's forward and backward captured ({what}"
                 f"{', one graph per half of a pair of micro-batches' if len(halves) > 1 else ''}; "
                 f"steps with FFN statistics run eagerly)")

    def _as_half(self, half: bool) -> None:
        if self.micro_batches is not None:
            self.micro_batches.keep = half

    def _open_states(self) -> list:
        """srelu24's step states, opened as training/step.py opens them eagerly (kept conversions where
        conversions_kept says) and kept for the phase. The op adds its weight gradients into .grad
        with one micro-batch a step too: .grad is the graph's kept buffer, zeroed after each step, so
        that saves writing dW in fp32 and autograd reading it back to add it (eagerly, with one
        micro-batch, autograd makes .grad of dW as it is)."""
        several = self.accum > 1
        self.micro_batches = MicroBatches() if several else None  # pairs across several micro-batches only
        states = []
        for m in self.ffns:
            m.begin_step(keep_conversions=conversions_kept(m, several), grads_in_place=True,
                         micro_batches=self.micro_batches)
            states.append(m.step_state)
        if not any(st is not None and st.pairs is not None for st in states):
            self.micro_batches = None  # no FFN pairs (the switch off, dense, not tensorwise e4m3)
        return states

    def _states_hold_grads(self) -> bool:
        """Whether each kept srelu24 step state that adds into .grad holds its weights' current .grad."""
        return all(st is None or st.grads is None
                   or (st.grads[0] is m.w1.weight.grad and st.grads[1] is m.w2.weight.grad)
                   for m, st in zip(self.ffns, self.states))

    def _refresh_conversions(self) -> None:
        """The current weights' e4m3 conversions, written into the kept ones (the graph's buffers)."""
        from srelu24_kernels.srelu24.op import convert_weights

        with torch.no_grad():
            for m, st in zip(self.ffns, self.states):
                if st is not None and st.weights is not None:
                    convert_weights(m.w1.weight, m.w2.weight, m.options, out=st.weights)
