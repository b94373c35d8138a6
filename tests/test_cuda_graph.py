"""trainer.cuda_graph (training/cuda_graph.py). On the CPU the micro-batches run eagerly through the
graph's fixed buffers (tokens, token orders, .grad zeroed in place, srelu24's kept step state): the
bookkeeping must give the eager trainer's run bit for bit, across srelu24's switch to 2:4 and
logged steps. The capture itself is the GPU test's."""
from contextlib import contextmanager, nullcontext

import pytest
import torch

from helpers import compose_config, to_object
from test_step import S, batches, parts_for, tiny
from training import cuda_graph
from training.config_checks import check_config
from training.cuda_graph import MicroBatchGraphs, graph_problem
from training.errors import ConfigError
from training.step import TrainState, train_step

MICRO = 4


def run(model, graphs: bool, steps: int = 6, accum: int = 2, sparse_from=2, log_every: int = 3,
        capture: bool = False, stats_every: int = 0):
    """`steps` optimizer steps: (the logged steps' losses, the final weights). capture: through the
    capture path, on _FakeCapture's stand-ins. stats_every: FFN statistics on these logged steps only
    (0: every logged step)."""
    parts = parts_for(model, accum=accum, micro=MICRO, sparse_from=sparse_from)
    if graphs:
        parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
        parts.graphs.capture = capture
        _FakeCapture.runner = parts.graphs
    state, data = TrainState(), iter(batches(steps * accum, MICRO))
    losses, collected = [], {}
    for i in range(steps):
        stats = (i + 1) % stats_every == 0 if stats_every else None
        out = train_step(parts, state, data.__next__, log=(i + 1) % log_every == 0, stats=stats)
        assert (out.stats is not None) == (out.loss is not None and stats is not False)
        if out.loss is not None:
            losses.append(out.loss)
        if out.stats is not None:
            collected[i + 1] = out.stats
    if graphs:
        parts.graphs.close()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, collected


class _FakeCapture:
    """torch.cuda's graph API on the CPU. A capture runs the micro-batch's Python, as a real one does,
    and undoes what it did to .grad (a real capture runs no kernel) and checks it drew no random
    numbers; a replay runs it again and writes the loss into the captured output tensor, as a
    replay writes the graph's fixed outputs."""
    runner = None
    replays = 0
    captures = 0

    def pool(self):
        return None

    def replay(self):
        _FakeCapture.replays += 1
        r = _FakeCapture.runner
        r.loss.copy_(r._run())

    @staticmethod
    @contextmanager
    def graph(graph, **kw):
        r = _FakeCapture.runner
        grads, rng = [p.grad.clone() for p in r.params], torch.get_rng_state()
        _FakeCapture.captures += 1
        yield
        assert torch.equal(rng, torch.get_rng_state()), "the capture drew random numbers"
        for p, g in zip(r.params, grads):
            p.grad.copy_(g)

    @classmethod
    def install(cls, monkeypatch):
        class Stream:
            def wait_stream(self, other):
                pass

        cls.replays = cls.captures = 0
        for name, value in {"Stream": Stream, "current_stream": lambda *a: Stream(), "CUDAGraph": cls,
                            "stream": lambda s: nullcontext(), "graph": cls.graph, "empty_cache": lambda: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)


def assert_same(a, b):
    assert a[0] == b[0]
    for n in a[1]:
        assert torch.equal(a[1][n], b[1][n]), n


@pytest.mark.parametrize("kind, accum", [("srelu24", 2), ("srelu24", 1), ("swiglu", 2)])
def test_the_graphs_buffers_train_as_the_eager_step(kind, accum):
    """Dense warmup, the switch to 2:4 at step 2 (srelu24: token orders drawn for the block from
    then on), logged steps 3 and 6: the same losses and weights, bit for bit."""
    sparse_from = 2 if kind == "srelu24" else None
    eager = run(tiny(kind), graphs=False, accum=accum, sparse_from=sparse_from)
    graphed = run(tiny(kind), graphs=True, accum=accum, sparse_from=sparse_from)
    assert len(eager[0]) == 2
    assert_same(graphed, eager)


@pytest.mark.parametrize("kind, accum", [("srelu24", 2), ("srelu24", 1), ("swiglu", 2)])
def test_the_capture_path_trains_as_the_eager_step(monkeypatch, kind, accum):
    """Through the capture path (warmup runs whose gradients are zeroed, a capture on the step's first
    micro-batch, replays into the fixed loss; logged steps eager; a new capture at the switch to
    2:4), on stand-ins for torch.cuda's graph API: bit for bit the eager run, and every micro-batch
    of the four unlogged steps replayed."""
    _FakeCapture.install(monkeypatch)
    sparse_from = 2 if kind == "srelu24" else None
    eager = run(tiny(kind), graphs=False, accum=accum, sparse_from=sparse_from)
    graphed = run(tiny(kind), graphs=True, accum=accum, sparse_from=sparse_from, capture=True)
    assert_same(graphed, eager)
    assert _FakeCapture.replays == 4 * accum


def test_logged_steps_without_statistics_replay_the_graph(monkeypatch):
    """Every step logged, the FFN statistics on steps 3 and 6 only (trainer.ffn_stats_every=3): the
    other four steps replay and their losses, read from the graph's output, are the eager ones; the
    statistics of steps 3 and 6 are those of a run that collects them on every step (no sums leak
    from the replayed steps into them)."""
    _FakeCapture.install(monkeypatch)
    every = run(tiny("srelu24"), graphs=False, log_every=1)
    eager = run(tiny("srelu24"), graphs=False, log_every=1, stats_every=3)
    graphed = run(tiny("srelu24"), graphs=True, log_every=1, stats_every=3, capture=True)
    assert len(eager[0]) == 6 and sorted(graphed[2]) == sorted(eager[2]) == [3, 6]
    assert_same(graphed, eager)
    assert_same(eager, every)
    for step in (3, 6):
        assert torch.equal(graphed[2][step], every[2][step]) and torch.equal(eager[2][step], every[2][step]), step
    assert _FakeCapture.replays == 4 * 2


def test_a_replaced_gradient_buffer_is_captured_anew(monkeypatch):
    """Something that drops .grad between steps (a zero_grad(set_to_none=True)): the graph would add
    into freed memory; it is captured again on the new buffers instead."""
    _FakeCapture.install(monkeypatch)
    model = tiny("srelu")
    parts = parts_for(model, accum=2, micro=MICRO)
    parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
    parts.graphs.capture, _FakeCapture.runner = True, parts.graphs
    data, state = iter(batches(6, MICRO)), TrainState()
    train_step(parts, state, data.__next__)
    first = parts.graphs.graphs[True][0]
    parts.optimizer.zero_grad(set_to_none=True)
    train_step(parts, state, data.__next__)
    assert parts.graphs.graphs[True][0] is not first
    assert all(p.grad is g for p, g in zip(parts.params, parts.graphs.grads))
    train_step(parts, state, data.__next__)
    assert _FakeCapture.replays == 6


@pytest.mark.parametrize("accum", [1, 2])
def test_srelu24s_step_states_take_a_replaced_grad(monkeypatch, accum):
    """.grad dropped after every step (zero_grad(set_to_none=True)) under a graph: srelu24's kept step
    states are opened anew on the new buffers (else the op would add W1's and W2's gradients into
    the dropped ones, and the optimizer would see zeros); the run is the eager one's, bit for bit."""
    from model.ffn import SReLU24
    from test_step_state import _cpu_kernel_path

    _cpu_kernel_path(monkeypatch, "rowwise", keep=False)
    eager = run(_srelu24_rowwise(), graphs=False, steps=4, log_every=2, accum=accum)
    m = _srelu24_rowwise()
    parts = parts_for(m, accum=accum, micro=MICRO, sparse_from=2)
    parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
    state, data = TrainState(), iter(batches(4 * accum, MICRO))
    losses = []
    for i in range(4):
        losses.append(train_step(parts, state, data.__next__, log=(i + 1) % 2 == 0).loss)
        if i < 3:
            parts.optimizer.zero_grad(set_to_none=True)
    assert [x for x in losses if x is not None] == eager[0]
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), eager[1][n]), n
    ffns = [f for f in m.modules() if isinstance(f, SReLU24)]
    assert all(st is not None and st.grads[0] is f.w1.weight.grad for f, st in zip(ffns, parts.graphs.states))


def test_the_token_orders_reach_the_model_through_the_fixed_buffer(monkeypatch):
    """Orders other than the eager model's (the buffer rolled by one token) train another model:
    the buffer is what the blocks read."""
    eager = run(tiny("srelu24"), graphs=False)
    draw = cuda_graph._OrderFeed.draw

    def rolled(self):
        draw(self)
        if self.buf is not None:
            self.buf.copy_(self.buf.roll(1, dims=-1))

    monkeypatch.setattr(cuda_graph._OrderFeed, "draw", rolled)
    graphed = run(tiny("srelu24"), graphs=True)
    assert any(not torch.equal(graphed[1][n], eager[1][n]) for n in eager[1])


def test_the_gradient_buffers_are_kept_and_zeroed_in_place():
    """The graph adds into the same .grad tensors every step: the optimizer zeroes them, it does
    not drop them; after close() the model draws its own token orders again."""
    model = tiny("srelu24")
    parts = parts_for(model, accum=2, micro=MICRO, sparse_from=0)
    parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
    data, state = iter(batches(4, MICRO)), TrainState()
    train_step(parts, state, data.__next__)
    grads = [p.grad for p in parts.params]
    assert all(g is not None and not g.any() for g in grads)
    train_step(parts, state, data.__next__)
    assert all(p.grad is g for p, g in zip(parts.params, grads))
    assert "token_orders" in model.__dict__
    parts.graphs.close()
    assert "token_orders" not in model.__dict__


def test_a_micro_batch_of_another_shape_is_refused():
    model = tiny("srelu")
    parts = parts_for(model, accum=1, micro=MICRO)
    parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
    x = torch.zeros(MICRO + 1, S, dtype=torch.long)
    with pytest.raises(ValueError, match=r"a micro-batch of \(5, 16\) tokens where the graph holds \(4, 16\)"):
        train_step(parts, TrainState(), lambda: (x, x))


@pytest.mark.parametrize("overrides, named", [
    (["trainer.device=cpu"], "a CUDA device (got cpu)"),
    (["trainer.activation_checkpointing=full"], "trainer.activation_checkpointing=none (got full"),
    (["model.attention=document"], "model.attention=causal (got document"),
])
def test_settings_the_graph_cannot_take_are_one_line(overrides, named):
    cfg = to_object(compose_config(["+experiment=demo", "trainer.cuda_graph=true", *overrides]))
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith("trainer.cuda_graph=true needs ") and named in line
    assert line.endswith("or set trainer.cuda_graph=false")


def test_a_dry_run_plans_a_graphed_run_from_a_machine_without_a_gpu():
    """The dry run's memory verdict counts the graph's pool (training/memory.py), so it takes the
    setting anywhere; the other limits still hold."""
    cfg = to_object(compose_config(["+experiment=demo", "trainer.cuda_graph=true", "trainer.dry_run=true",
                                    "trainer.device=cpu"]))
    check_config(cfg)
    cfg.trainer.activation_checkpointing = type(cfg.trainer.activation_checkpointing)("full")
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing=none"):
        check_config(cfg)


def test_several_processes_are_refused_and_the_default_is_eager():
    assert "one process and trainer.strategy=none (got 2 process(es), strategy=ddp" in graph_problem(
        True, 2, "ddp", "none", "causal")
    assert graph_problem(False, 2, "fsdp", "full", "document", torch.device("cpu")) is None
    assert graph_problem(True, 1, "none", "none", "causal", torch.device("cuda", 0)) is None
    assert to_object(compose_config(["+experiment=demo"])).trainer.cuda_graph is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, accum", [("srelu", 2), ("srelu24", 2), ("srelu24", 3)])
def test_the_captured_step_trains_as_the_eager_step_on_the_gpu(kind, accum):
    """The real capture, the model built as the trainer builds it (float8 tensorwise where the GPU
    has it, compiled blocks and loss head, srelu24's kernels and step state): the same losses and
    weights as eager, bit for bit, through the switch to 2:4 and logged steps (step 3 without the FFN
    statistics: its loss read from the replayed graph), wherever the eager run repeats itself bit
    for bit (else within twice its own spread). srelu24 with three micro-batches: its pairs' first
    graph replays twice a step, the last one's kept products added when the step ends."""
    from model import FFNConfig, ModelConfig, Transformer
    from training.config import Float8, TrainerConfig
    from training.distributed import Dist, build_model
    from training.step import StepParts

    dev = torch.device("cuda")
    f8 = Float8.tensorwise if torch.cuda.get_device_capability(dev) >= (8, 9) else Float8.none
    t = TrainerConfig(compile=True, float8=f8, device="cuda")
    d = Dist(device=dev)
    B, L, V = 8, 256, 512

    def go(graphs: bool):
        cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, max_seq_len=L)
        m, _ = build_model(lambda: Transformer(cfg, FFNConfig(kind=kind, hidden_dim=1024), V, float8=f8.value),
                           t, d, 0, False)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        parts = StepParts(model=m, train_module=m, optimizer=opt, dist=d, accum=accum, tokens_per_step=accum * B * L,
                          lr_at=lambda s: 1e-3, grad_clip=1.0, sparse_from=2 if kind == "srelu24" else None,
                          autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if graphs:
            parts.graphs = MicroBatchGraphs.for_step(parts, B, L)
        g = torch.Generator().manual_seed(3)
        toks = [torch.randint(0, V, (B, L + 1), generator=g) for _ in range(6 * accum)]
        data = iter([(x[:, :-1].contiguous().to(dev), x[:, 1:].contiguous().to(dev)) for x in toks])
        torch.manual_seed(11)  # the token orders' generator, the same for every run
        state, losses = TrainState(), []
        for i in range(6):
            losses.append(train_step(parts, state, data.__next__, log=i in (3, 5), stats=i == 5).loss)
        if graphs:  # steps 0-4 replayed (5 collects the statistics: eager), `accum` micro-batches each
            assert parts.graphs.replays == 5 * accum
            # srelu24 in tensorwise e4m3 on sm90 pairs its weight gradients: a graph per half of a pair
            pairs = kind == "srelu24" and f8 == Float8.tensorwise and torch.cuda.get_device_capability(dev) == (9, 0)
            assert len(parts.graphs.graphs) == (2 if pairs else 1)
            parts.graphs.close()
        return losses, {n: p.detach().float().clone() for n, p in m.named_parameters()}

    a, b, graphed = go(False), go(False), go(True)
    if a[0] == b[0] and all(torch.equal(a[1][n], b[1][n]) for n in a[1]):
        assert_same(graphed, a)
    else:
        for n in a[1]:
            spread = (a[1][n] - b[1][n]).norm()
            assert (graphed[1][n] - a[1][n]).norm() <= 2 * spread + 1e-12, n


def test_srelu24s_kept_step_state_is_refreshed_each_step(monkeypatch):
    """The op's kernel path on the CPU (test_step_state.py's stand-ins), float8 rowwise, several
    micro-batches: the graph keeps one step state per FFN for the 2:4 phase, and each step copies
    the new weights' e4m3 conversions into it; the run is the eager one's, bit for bit."""
    from model import FFNConfig, ModelConfig, Transformer
    from model.ffn import SReLU24
    from test_step_state import _cpu_kernel_path

    _cpu_kernel_path(monkeypatch, "rowwise", keep=True)

    def model():
        torch.manual_seed(0)
        cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=S)
        return Transformer(cfg, FFNConfig(kind="srelu24", hidden_dim=64), 64, float8="rowwise")

    eager = run(model(), graphs=False, steps=4, log_every=2)
    m = model()
    parts = parts_for(m, accum=2, micro=MICRO, sparse_from=2)
    parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
    state, data = TrainState(), iter(batches(8, MICRO))
    kept, losses = [], []
    for i in range(4):
        out = train_step(parts, state, data.__next__, log=(i + 1) % 2 == 0)
        losses.append(out.loss)
        kept.append([st.weights.for_y[0].data_ptr() if st else None for st in parts.graphs.states])
    ffns = [f for f in m.modules() if isinstance(f, SReLU24)]
    assert all(f.step_state is None for f in ffns)  # outside the step: evaluations read the weights
    assert kept[0] == [None, None] and None not in kept[2] and kept[2] == kept[3]  # one state, kept
    assert [x for x in losses if x is not None] == eager[0]
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), eager[1][n]), n


def _srelu24_rowwise():
    """A srelu24 model whose op takes its kernel path on the CPU (with _cpu_kernel_path): float8
    rowwise, so that its step states add the weight gradients into .grad."""
    from model import FFNConfig, ModelConfig, Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=S)
    return Transformer(cfg, FFNConfig(kind="srelu24", hidden_dim=64), 64, float8="rowwise")


def test_srelu24_adds_into_the_graphs_grad_with_one_micro_batch_too(monkeypatch):
    """One micro-batch a step: the graph's srelu24 step states take the kept .grad buffers, so the op
    adds its weight gradients into them (no fp32 dW for autograd to add); the run is the eager one's
    (where autograd assigns .grad), bit for bit."""
    from model.ffn import SReLU24
    from test_step_state import _cpu_kernel_path

    _cpu_kernel_path(monkeypatch, "rowwise", keep=False)
    model = _srelu24_rowwise
    eager = run(model(), graphs=False, steps=4, log_every=2, accum=1)
    m = model()
    parts = parts_for(m, accum=1, micro=MICRO, sparse_from=2)
    parts.graphs = MicroBatchGraphs.for_step(parts, MICRO, S)
    state, data = TrainState(), iter(batches(4, MICRO))
    losses = [train_step(parts, state, data.__next__, log=(i + 1) % 2 == 0).loss for i in range(4)]
    ffns = [f for f in m.modules() if isinstance(f, SReLU24)]
    assert all(st is not None and st.grads == (f.w1.weight.grad, f.w2.weight.grad)
               for f, st in zip(ffns, parts.graphs.states))
    assert [x for x in losses if x is not None] == eager[0]
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), eager[1][n]), n


def _srelu24_tensorwise(paired: bool):
    """A srelu24 model whose op takes its tensorwise e4m3 path on the CPU (with test_paired_grads'
    _e4m3_path_on_the_cpu), pairing its weight gradients or not; 64 tokens a micro-batch."""
    from model import FFNConfig, ModelConfig, Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=S)
    return Transformer(cfg, FFNConfig(kind="srelu24", hidden_dim=64, paired_grad_unscaling=paired), 64,
                       float8="tensorwise")


def test_paired_weight_gradients_are_two_graphs_that_train_as_the_eager_step(monkeypatch):
    """ffn.paired_grad_unscaling under the graph: the 2:4 phase captures a graph for each half of a
    pair and replays them in turn; with three micro-batches the third, a pair's first, adds its kept
    products when the step ends. The run is the unpaired eager one's, bit for bit (paired and
    unpaired eager steps agree: tests/test_paired_grads.py). Steps 1-2 dense, 3 captures, 4 logged."""
    from test_paired_grads import _e4m3_path_on_the_cpu

    _e4m3_path_on_the_cpu(monkeypatch)
    _FakeCapture.install(monkeypatch)
    accum = 3
    unpaired = run(_srelu24_tensorwise(False), graphs=False, steps=4, accum=accum, log_every=4)
    graphed = run(_srelu24_tensorwise(True), graphs=True, steps=4, accum=accum, log_every=4, capture=True)
    assert_same(graphed, unpaired)
    assert _FakeCapture.replays == 3 * accum
    assert _FakeCapture.captures == 1 + 2  # the dense warmup's graph, then one per half of a pair


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_py_with_a_graph_trains_and_resumes_as_without(tmp_path, corpus, cache):
    """The trainer end to end: srelu24 with 2:4 from step 4, a background checkpoint at step 4 (its
    writer runs while the 2:4 graph is captured), logged steps, evaluation; stopped at step 6 and
    resumed. Every logged loss and the final weights equal the eager run's, wherever two eager runs
    equal each other (else within twice their spread)."""
    import json

    from helpers import run_train, tiny_overrides, with_cache
    from test_train import final_weights

    extra = ["ffn=srelu24", "ffn.hidden_dim=128", "ffn.dense_warmup_steps=4", "trainer.max_steps=10",
             "trainer.ckpt_every=4", "trainer.log_every=3", "trainer.eval_every=5", "ffn.sparse_gemm_alg=0"]
    runs = {}
    for name, graph in (("eager", "false"), ("eager_again", "false"), ("graphed", "true")):
        args = with_cache(tiny_overrides(tmp_path / name, corpus, extra + [f"trainer.cuda_graph={graph}"]), cache)
        r = run_train(args + ["trainer.stop_at_step=6"])
        assert r.returncode == 0, r.stderr[-3000:]
        r = run_train(args + ["trainer.resume=auto"])
        assert r.returncode == 0, r.stderr[-3000:]
        run = tmp_path / name / "run"
        rows = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        runs[name] = ({s: (m.get("loss"), m.get("val_loss")) for s, m in rows.items()}, final_weights(run))
    (a, wa), (b, wb), (g, wg) = runs["eager"], runs["eager_again"], runs["graphed"]
    if a == b and all(torch.equal(wa[k], wb[k]) for k in wa):
        assert g == a
        for k in wa:
            assert torch.equal(wg[k], wa[k]), k
    else:
        for k in wa:
            assert (wg[k].float() - wa[k].float()).norm() <= 2 * (wb[k].float() - wa[k].float()).norm() + 1e-12, k
