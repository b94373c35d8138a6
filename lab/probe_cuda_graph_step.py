"""Probe: a step whose micro-batches replay one CUDA graph (a micro-batch's forward and backward,
captured by hand with torch.cuda.graph) against the trainer's eager step (training/step.py), at an
experiment's shapes, for each FFN, in one process. The 1B float8 srelu24 step waits on the host
(benchmarks/RESULTS.md, "The step at trained sparsity"); a replay costs one launch.

    python lab/probe_cuda_graph_step.py +experiment=study_speed --ffns srelu,srelu24 --accum 4 --steps 5
    python lab/probe_cuda_graph_step.py +experiment=demo --device cpu --no-compile --layers 1   # bookkeeping only

Per FFN, from one model:
1. eager: the trainer's train_step, timed (tokens/s; SM clock, power and J a step where NVML is);
2. gradients of one step's micro-batches from the same weights, batches and token orders: eager
   twice (the kernels' own run-to-run differences) and replayed (captured on another batch),
   torch.equal per parameter;
3. graphed: the same step with its micro-batches replayed, token orders drawn fresh on the host
   per micro-batch as the eager model draws them, timed as in 1;
4. the check of 2 again after those steps' updates (the replay must read the new weights and
   their conversions);
5. eager timed again, so that the two eager figures bracket the graphed one.
The verdict: "bit-identical" (no gradient differs in 2 or 4), "within noise" (eager differs from
itself, and the replay from eager by no more than twice that), or "differs".

What the graph needs, and how the probe gives it (the capture bakes in every address it reads):
- static inputs: the micro-batch's tokens and srelu24's token orders are copied into fixed
  buffers before each replay (the model's `token_orders` is replaced by a reader of that buffer);
- fixed .grad: every parameter's gradient is allocated once and zeroed in place between steps
  (zero_grad(set_to_none=False)); autograd then adds each micro-batch into it, as srelu24's op
  does with its weight gradients (grads_in_place). cudagraph trees (torch.compile's
  mode="reduce-overhead") hand a graph's output buffers to its next replay, which breaks this
  accumulation (lab/LOG.md), hence a graph captured by hand;
- srelu24's step state (its weights' e4m3 conversions, model/ffn.py begin_step) opened once and
  kept: each step converts the new weights and copies them into the captured buffers;
- nothing that syncs or allocates host memory inside the captured micro-batch: logged steps
  (the FFN statistics) are not measured here.
On a CPU the "graph" calls the captured function again: the bookkeeping is checked, not the capture.
"""
import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_step import load_config  # noqa: E402
from model import Transformer  # noqa: E402
from model.ffn import SReLU24, srelu24_step  # noqa: E402
from training.distributed import build_model, clip_grad_norm, setup, shutdown  # noqa: E402
from training.gpu_clocks import ClockSampler  # noqa: E402
from training.loop import autocast_for  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.step import StepParts, TrainState, optimizer_step_skipping_on_device, train_step  # noqa: E402
from srelu24_kernels.srelu24.reference import random_token_orders  # noqa: E402


class OrderFeed:
    """The model's token orders read from one fixed device buffer, refilled before each micro-batch."""

    def __init__(self, model: Transformer, T: int, device):
        self.wants = [layer.feed_forward.wants_token_order() for layer in model.layers]
        self.n = sum(self.wants)
        self.buf = torch.zeros(max(self.n, 1), 2, T, dtype=torch.int32, device=device)
        model.token_orders = self  # the instance attribute shadows Transformer.token_orders

    def __call__(self, T: int, device):
        if not self.n or not torch.is_grad_enabled():
            return None
        rows = iter(self.buf.unbind(0))
        return [next(rows) if w else None for w in self.wants]

    def load(self, orders: torch.Tensor) -> None:
        if self.n:
            self.buf.copy_(orders, non_blocking=True)


class GraphedMicroBatch:
    """One micro-batch's forward and backward as a CUDA graph over fixed buffers (the module docstring)."""

    def __init__(self, parts: StepParts, feed: OrderFeed, B: int, S: int, device):
        self.parts, self.feed, self.device = parts, feed, device
        self.x = torch.zeros(B, S, dtype=torch.long, device=device)
        self.y = torch.zeros(B, S, dtype=torch.long, device=device)
        for p in parts.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        self.grads = [p.grad for p in parts.params]
        self.ffns = [m for m in parts.model.modules() if isinstance(m, SReLU24)]
        several = parts.accum > 1
        for m in self.ffns:
            m.begin_step(keep_conversions=several, grads_in_place=several)
        self.states = [m.step_state for m in self.ffns]  # kept for the graph's life (end_step never runs)
        self.graph, self.loss = None, None

    def zero_grads(self) -> None:
        torch._foreach_zero_(self.grads)

    def refresh_conversions(self) -> None:
        """The current weights' e4m3 conversions, into the buffers the graph reads."""
        from srelu24_kernels.srelu24.op import convert_weights

        for m, st in zip(self.ffns, self.states):
            if st is not None and st.weights is not None:
                fresh = convert_weights(m.w1.weight, m.w2.weight, m.options)
                for dst, src in zip(st.weights.flat(), fresh.flat()):
                    dst.copy_(src)

    def _micro(self) -> torch.Tensor:
        for m, st in zip(self.ffns, self.states):
            m.step_state = st
        with self.parts.autocast():
            loss = self.parts.train_module(self.x, self.y)
        (loss / self.parts.accum).backward()
        return loss.detach()

    def capture(self, x, y, orders, warmup: int = 3) -> None:
        """Warm up on a side stream (compilation, cuSPARSELt plans, cuBLAS workspaces), then capture."""
        self.x.copy_(x)
        self.y.copy_(y)
        self.feed.load(orders)
        if self.device.type != "cuda":
            self._micro()
            self.zero_grads()
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                self._micro()
        torch.cuda.current_stream().wait_stream(s)
        self.zero_grads()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._micro()
        self.zero_grads()

    def micro(self, x, y, orders) -> torch.Tensor:
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.feed.load(orders)
        if self.graph is None:
            return self._micro()
        self.graph.replay()
        return self.loss


def eager_grads(parts: StepParts, feed: OrderFeed, batches, orders) -> tuple[dict, torch.Tensor]:
    """One step's micro-batches as training/step.py runs them (no optimizer): the gradients and the loss sum."""
    model = parts.model
    parts.optimizer.zero_grad(set_to_none=True)
    several = parts.accum > 1
    loss_sum = torch.zeros((), device=batches[0][0].device)
    with srelu24_step(model, keep_conversions=several, grads_in_place=several):
        for (x, y), o in zip(batches, orders):
            feed.load(o)
            with parts.autocast():
                loss = parts.train_module(x, y)
            (loss / parts.accum).backward()
            loss_sum += loss.detach()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss_sum


def graphed_grads(runner: GraphedMicroBatch, batches, orders) -> tuple[dict, torch.Tensor]:
    runner.zero_grads()
    runner.refresh_conversions()
    loss_sum = torch.zeros((), device=batches[0][0].device)
    for (x, y), o in zip(batches, orders):
        loss_sum += runner.micro(x, y, o)
    model = runner.parts.model
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss_sum


def compare(a: dict, b: dict) -> dict:
    """Parameters whose gradients differ (torch.equal), and the largest difference relative to the gradient's norm."""
    differ, worst = [], 0.0
    for n in a:
        if n not in b or not torch.equal(a[n], b[n]):
            differ.append(n)
            if n in b:
                worst = max(worst, ((a[n].float() - b[n].float()).norm() / a[n].float().norm().clamp(min=1e-30)).item())
    return {"params": len(a), "differ": len(differ), "first_differing": differ[:5], "max_rel_diff": worst}


def timed(step, steps: int, device) -> dict:
    """Back-to-back steps between two CUDA events (one sync at the end), NVML sampled meanwhile."""
    cuda = device.type == "cuda"
    with (ClockSampler(device) if cuda else _Null()) as clocks:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        else:
            import time
            t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / steps
        else:
            ms = (time.perf_counter() - t0) * 1e3 / steps
    out = {"step_ms": ms}
    if cuda and clocks is not None:
        s = clocks.summary()
        out.update(sm_clock_mhz=s.get("sm_clock_mhz"), power_w=s.get("power_w"))
        if "energy_j" in s:
            out["step_j"] = s["energy_j"] / steps
    return out


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run(cfg, args, d) -> dict:
    device, t = d.device, cfg.trainer
    if d.world_size != 1 or t.activation_checkpointing.value != "none":
        raise SystemExit("error: the probe captures one process's step without activation checkpointing (DDP's "
                         "hooks and checkpointing's RNG reads do not belong in the graph); run it with one process "
                         "and trainer.activation_checkpointing=none")
    model_cfg = replace(cfg.model, n_layers=args.layers) if args.layers else cfg.model
    vocab = model_cfg.vocab_size or cfg.data.vocab_size
    model, step_module = build_model(lambda: Transformer(model_cfg, cfg.ffn, vocab, eot_id=0, float8=t.float8.value),
                                     t, d, 0, False)
    assert step_module is model  # no wrapper: what the graph captures is the model's own forward
    opt = build_optimizer(model, cfg.optim, device)
    B, S, A = t.micro_batch_size, t.seq_len, args.accum
    parts = StepParts(model=model, train_module=step_module, optimizer=opt, dist=d, accum=A,
                      tokens_per_step=A * B * S, lr_at=lambda step: cfg.optim.lr, grad_clip=cfg.optim.grad_clip,
                      sparse_from=0 if cfg.ffn.kind == "srelu24" else None,
                      autocast=autocast_for(t.precision, t.strategy, device), nonfinite=t.nonfinite)
    state = TrainState()
    g = torch.Generator().manual_seed(1234)

    def random_batch():  # contiguous, as the trainer's loader hands them over (a stride is a compile guard)
        tok = torch.randint(1, vocab, (B, S + 1), generator=g)
        return tok[:, :-1].contiguous().to(device), tok[:, 1:].contiguous().to(device)

    pool = [random_batch() for _ in range(A)]  # one step's micro-batches, reused by every step
    nxt = iter(range(10**9))

    def next_batch():
        return pool[next(nxt) % A]

    def eager_step():
        train_step(parts, state, next_batch)

    # 1. eager, the trainer's step (its own token orders, drawn on the host per micro-batch)
    for _ in range(max(args.warmup, 1)):
        eager_step()
    eager = [timed(eager_step, args.steps, device)]

    # 2. gradients from the same weights: eager twice, then captured (on a batch not compared) and replayed
    model.set_2to4(parts.sparse_from is not None)
    feed = OrderFeed(model, B * S, device)
    n_orders = max(feed.n, 1)
    orders = [random_token_orders(B * S, n_orders, "cpu", generator=g) for _ in range(A)]
    ref, ref_loss = eager_grads(parts, feed, pool, orders)
    again, again_loss = eager_grads(parts, feed, pool, orders)
    runner = GraphedMicroBatch(parts, feed, B, S, device)
    runner.capture(*random_batch(), random_token_orders(B * S, n_orders, "cpu", generator=g))
    got, got_loss = graphed_grads(runner, pool, orders)
    checks = {"eager_vs_eager": compare(ref, again), "eager_vs_graph": compare(ref, got),
              "loss_eager": ref_loss.item(), "loss_eager_again": again_loss.item(), "loss_graph": got_loss.item()}

    # 3. graphed steps: the weights' conversions, fresh token orders per micro-batch (as the eager
    # model draws them), replays, clip, the fused optimizer's on-device skip, .grad zeroed in place
    def graphed_step():
        runner.refresh_conversions()
        loss_sum = torch.zeros((), device=device)
        for _ in range(A):
            x, y = next_batch()
            o = random_token_orders(B * S, feed.n, device) if feed.n else None
            loss_sum += runner.micro(x, y, o)
        norm = clip_grad_norm(parts.params, parts.grad_clip if parts.grad_clip > 0 else float("inf"))
        if parts.skip_on_device:
            optimizer_step_skipping_on_device(parts, state, norm)
        else:
            opt.step()
        opt.zero_grad(set_to_none=False)  # in place: the graph adds into these buffers

    runner.zero_grads()  # the check above left its gradients there
    for _ in range(max(args.warmup, 1)):
        graphed_step()
    graphed = timed(graphed_step, args.steps, device)

    # 4. the check again after the weights moved: the replay must see the new weights (and their
    # conversions). Replayed first: the eager step then drops the .grad buffers the graph writes
    got2, got2_loss = graphed_grads(runner, pool, orders)
    ref2, ref2_loss = eager_grads(parts, feed, pool, orders)
    checks.update(eager_vs_graph_updated=compare(ref2, got2), loss_eager_updated=ref2_loss.item(),
                  loss_graph_updated=got2_loss.item())

    # 5. eager again (its own token orders): the two eager figures bracket the graphed one in time
    del model.token_orders
    runner.graph = None
    eager.append(timed(eager_step, args.steps, device))
    checks["verdict"] = verdict(checks)
    tokens = A * B * S
    eager_ms = sum(e["step_ms"] for e in eager) / len(eager)
    return {"ffn": cfg.ffn.kind, "float8": t.float8.value, "accum": A, "micro_batch": B, "seq_len": S,
            "n_layers": model_cfg.n_layers, "eager": eager, "graphed": graphed, "check": checks,
            "eager_tokens_per_s": tokens / (eager_ms / 1e3), "graphed_tokens_per_s": tokens / (graphed["step_ms"] / 1e3)}


def verdict(c: dict) -> str:
    """"bit-identical" where no gradient differs (before and after an update); else "within noise"
    where the replay differs from eager no more than eager from itself (x2), else "differs"."""
    g1, g2, ee = c["eager_vs_graph"], c["eager_vs_graph_updated"], c["eager_vs_eager"]
    if g1["differ"] == g2["differ"] == 0:
        return "bit-identical"
    if ee["differ"] and max(g1["max_rel_diff"], g2["max_rel_diff"]) <= 2 * ee["max_rel_diff"]:
        return "within noise"
    return "differs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ffns", default="srelu,srelu24")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "probe_cuda_graph_step.json")
    ap.add_argument("override", nargs="*")
    args = ap.parse_intermixed_args()
    if args.accum < 1 or args.steps < 1:
        ap.error(f"--accum and --steps must be positive; got {args.accum}, {args.steps}")
    rows = []
    d = None
    for v in args.ffns.split(","):
        cfg = load_config(args.override + [f"ffn={v}"])
        cfg.ffn.kind = v
        cfg.trainer.device = args.device
        cfg.trainer.compile = cfg.trainer.compile and not args.no_compile
        d = d or setup(cfg.trainer)
        rows.append(run(cfg, args, d))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()  # the model and its graph sit in reference cycles: free them before the next FFN's
        torch._dynamo.reset()
        if d.device.type == "cuda":
            torch.cuda.empty_cache()
    shutdown(d)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": sys.argv, "results": rows}, indent=2))
    print("\n| ffn | eager tok/s | graphed tok/s | ratio | eager MHz, W, J (before; after) | graphed MHz, W, J "
          "| grads differ: eager/eager, eager/graph, after an update | rel. diff eager/eager, graph | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, g, c = r["eager"], r["graphed"], r["check"]
        clocks = "; ".join(f"{x.get('sm_clock_mhz')}, {x.get('power_w')}, {x.get('step_j')}" for x in e)
        n = c["eager_vs_eager"]["params"]
        print(f"| {r['ffn']} | {r['eager_tokens_per_s']:,.0f} | {r['graphed_tokens_per_s']:,.0f} | "
              f"{r['graphed_tokens_per_s'] / r['eager_tokens_per_s']:.3f}x | {clocks} | "
              f"{g.get('sm_clock_mhz')}, {g.get('power_w')}, {g.get('step_j')} | "
              f"{c['eager_vs_eager']['differ']}/{n}, {c['eager_vs_graph']['differ']}/{n}, "
              f"{c['eager_vs_graph_updated']['differ']}/{n} | {c['eager_vs_eager']['max_rel_diff']:.1e}, "
              f"{max(c['eager_vs_graph']['max_rel_diff'], c['eager_vs_graph_updated']['max_rel_diff']):.1e} | "
              f"{c['verdict']} |")
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
