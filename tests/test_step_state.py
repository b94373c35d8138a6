"""srelu24's step state (srelu24_kernels/srelu24/options.py StepState, model/ffn.py srelu24_step): the e4m3
weight conversions made once per optimizer step, and the op adding its weight gradients into the
weights' .grad. The kernels that add (CPU: TRITON_INTERPRET), the op against autograd over
micro-batches (CPU fallbacks; on a GPU the e4m3 path, eager and compiled), what train_step opens
(one process, DDP and FSDP2 on gloo), the stale cases, and the memory estimate's part."""
from dataclasses import replace

import pytest
import torch

from helpers import cpu_scaled_mm_runs
from srelu24_kernels.float8 import gemm as fp8_gemm
from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.options import OpOptions
from srelu24_kernels.srelu24.reference import SReLU24Recipe
from srelu24_kernels.srelu24.sparsify_backward import dense_slots, write_dense_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_unscale_adds_into_a_gradient_as_adding_its_result_would():
    g = torch.Generator().manual_seed(0)
    m, n, k = 64, 256, 5
    y = (torch.randn(m, n, generator=g) * 8).bfloat16().to(DEV)
    sr = torch.exp2(torch.randint(-4, 5, (m,), generator=g).float()).to(DEV)
    sc = torch.exp2(torch.randint(-4, 5, (n,), generator=g).float()).to(DEV)
    slots = dense_slots(torch.tensor([3, 17, 100, 101, 255]).to(DEV), n, DEV)[0]
    rows = torch.randn(k, m, generator=g).bfloat16().to(DEV)
    for dense_columns in (None, (slots, rows)):
        fresh = fp8_sparse.unscale(y, row_scale=sr, col_scale=sc, out_dtype=torch.float32, dense_columns=dense_columns)
        grad = torch.randn(m, n, generator=g).to(DEV)
        want = grad + fresh
        got = fp8_sparse.unscale(y, row_scale=sr, col_scale=sc, out_dtype=torch.float32, dense_columns=dense_columns,
                                 accumulate_into=grad)
        assert got is grad and torch.equal(got, want)
    with pytest.raises(ValueError, match="accumulates into a contiguous"):
        fp8_sparse.unscale(y, row_scale=sr, col_scale=sc, out_dtype=torch.float32, accumulate_into=grad.t())


def test_dense_rows_add_into_a_gradient():
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(40, 128, generator=g).to(DEV)
    dense = torch.tensor([0, 7, 39]).to(DEV)
    rows = torch.randn(3, 128, generator=g).bfloat16().to(DEV)
    want = grad.clone()
    want[dense] += rows.float()
    write_dense_rows(grad, dense, rows, accumulate=True)
    assert torch.equal(grad, want)


# ---------------------------------------------------------------- the module over micro-batches

def _module(w1, w2, float8: str, dev: str):
    from model.ffn import SReLU24

    m = SReLU24(w1.shape[1], w1.shape[0], OpOptions(SReLU24Recipe(token_permutation=False), float8)).to(dev)
    m.w1.weight.data, m.w2.weight.data = w1.clone(), w2.clone()
    m.set_2to4(True)
    return m


def _steps(m, batches, steps: int, keep: bool, in_place: bool, compiled: bool = False, lr: float = 1e-2) -> list:
    """`steps` AdamW steps of the module, each over all `batches` (x, dy) as micro-batches inside
    srelu24_step(keep, in_place), bf16 autocast on a GPU: per step, the gradients after each
    micro-batch, then the weights."""
    from model.ffn import srelu24_step

    fwd = torch.compile(m) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    dev = m.w1.weight.device.type
    out = []
    for _ in range(steps):
        with srelu24_step(m, keep_conversions=keep, grads_in_place=in_place):
            for x, dy in batches:
                x = x.clone().requires_grad_()
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    y = fwd(x)
                y.backward(dy)
                out.append([y.detach(), x.grad, m.w1.weight.grad.clone(), m.w2.weight.grad.clone()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([m.w1.weight.detach().clone(), m.w2.weight.detach().clone()])
    return out


def _batches(T, d, dev, n=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, d, generator=g).bfloat16().to(dev), torch.randn(T, d, generator=g).bfloat16().to(dev))
            for _ in range(n)]


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"entry {i}, tensor {j}"


def _cpu_kernel_path(monkeypatch, float8: str, keep: bool) -> None:
    """The op's kernel path on the CPU: cuSPARSELt stood in for, the dense float8 GEMMs on the CPU's
    _scaled_mm, the 2:4 GEMMs bf16 fallbacks; with keep, conversions are made as on an sm90 GPU
    (Triton interpreted), the dense ones then used."""
    import model.ffn as ffn
    from test_kernels import _cslt_stand_in

    if not cpu_scaled_mm_runs(float8):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run {float8} (torch 2.13 does)")
    _cslt_stand_in(monkeypatch)
    monkeypatch.setattr(ffn, "kernels_available", lambda x: True)
    if keep:
        monkeypatch.setattr(fp8_sparse, "available", lambda device: True)


@pytest.mark.parametrize("keep, in_place", [(False, True), (True, False), (True, True)])
def test_the_step_state_gives_autograds_steps_on_the_cpu(monkeypatch, keep, in_place):
    """Two optimizer steps of three micro-batches: the gradients after each micro-batch and the
    weights after each step bit for bit those of the op without a step state (rowwise: the dense
    GEMMs through the kept conversions)."""
    _cpu_kernel_path(monkeypatch, "rowwise", keep)
    torch.manual_seed(2)
    T, d, F_ = 64, 64, 64
    w1, w2 = torch.randn(F_, d) * d ** -0.5, torch.randn(d, F_) * F_ ** -0.5
    batches = _batches(T, d, "cpu")
    calls, real = [], fp8_gemm.b_operand
    monkeypatch.setattr(fp8_gemm, "b_operand", lambda b, r: calls.append(tuple(b.shape)) or real(b, r))
    got = _steps(_module(w1, w2, "rowwise", "cpu"), batches, 2, keep, in_place)
    n_kept = len(calls)
    calls.clear()
    _assert_same(got, _steps(_module(w1, w2, "rowwise", "cpu"), batches, 2, False, False))
    assert len(calls) == 2 * 3 * 2  # W1^T (forward) and W2 (backward) per micro-batch, without a state
    assert n_kept == (2 * 2 if keep else 2 * 3 * 2)  # with kept conversions: per step


def test_with_gradients_in_place_the_first_micro_batch_makes_grad_and_the_rest_add_into_it(monkeypatch):
    """No .grad at the step's start (set to None after the last optimizer step): nothing is
    allocated or zeroed; the first micro-batch's dW1, dW2 become .grad as autograd assigns them, the
    op gets those tensors from the second micro-batch on and adds into them (.grad stays them), and
    the hooks that took them are gone after the step. The sums are autograd's, bit for bit."""
    import srelu24_kernels.srelu24.op as op
    from model.ffn import srelu24_step

    _cpu_kernel_path(monkeypatch, "rowwise", False)
    given, real = [], op.ffn_forward
    monkeypatch.setattr(op, "ffn_forward", lambda *a: given.append((a[4], a[5])) or real(*a))  # grad_w1, grad_w2
    w1, w2 = torch.randn(64, 64) / 8, torch.randn(64, 64) / 8
    m, ref = _module(w1, w2, "rowwise", "cpu"), _module(w1, w2, "rowwise", "cpu")
    batches = _batches(64, 64, "cpu", n=3)
    with srelu24_step(m, keep_conversions=False, grads_in_place=True):
        assert m.w1.weight.grad is None and m.w2.weight.grad is None and m.step_state is not None
        m(batches[0][0]).backward(batches[0][1])
        first = m.w1.weight.grad, m.w2.weight.grad
        assert first[0] is not None and m.step_state.grads == first
        for x, dy in batches[1:]:
            m(x).backward(dy)
    assert given[0] == (None, None) and all(g[0] is first[0] and g[1] is first[1] for g in given[1:])
    assert m.w1.weight.grad is first[0] and m.w2.weight.grad is first[1] and m.step_state is None
    assert not m._grad_hooks and not m.w1.weight._post_accumulate_grad_hooks and not m.w2.weight._post_accumulate_grad_hooks
    for x, dy in batches:
        ref(x).backward(dy)
    assert torch.equal(m.w1.weight.grad, ref.w1.weight.grad) and torch.equal(m.w2.weight.grad, ref.w2.weight.grad)


def test_with_gradients_in_place_a_grad_already_there_is_added_into_from_the_first_micro_batch(monkeypatch):
    """.grad kept between steps (zeroed in place, as under trainer.cuda_graph): the op adds into it at
    once, and no hook is registered."""
    from model.ffn import srelu24_step

    _cpu_kernel_path(monkeypatch, "rowwise", False)
    w1, w2 = torch.randn(64, 64) / 8, torch.randn(64, 64) / 8
    m, ref = _module(w1, w2, "rowwise", "cpu"), _module(w1, w2, "rowwise", "cpu")
    buffers = torch.zeros_like(m.w1.weight), torch.zeros_like(m.w2.weight)
    m.w1.weight.grad, m.w2.weight.grad = buffers
    x, dy = _batches(64, 64, "cpu", n=1)[0]
    with srelu24_step(m, keep_conversions=False, grads_in_place=True):
        assert m.step_state.grads == buffers and not m._grad_hooks
        m(x).backward(dy)
    ref(x).backward(dy)
    assert m.w1.weight.grad is buffers[0] and m.w2.weight.grad is buffers[1]
    assert torch.equal(buffers[0], ref.w1.weight.grad) and torch.equal(buffers[1], ref.w2.weight.grad)


def test_no_state_outside_e4m3_mode_or_the_2to4_phase(monkeypatch):
    from model.ffn import srelu24_step

    _cpu_kernel_path(monkeypatch, "rowwise", True)
    w1, w2 = torch.randn(64, 64) / 8, torch.randn(64, 64) / 8
    bf16_sparse = _module(w1, w2, "rowwise", "cpu")
    bf16_sparse.options = replace(bf16_sparse.options, sparse_float8=False)
    dense_phase = _module(w1, w2, "rowwise", "cpu")
    dense_phase.set_2to4(False)
    for m in (_module(w1, w2, "none", "cpu"), bf16_sparse, dense_phase):
        with srelu24_step(m, keep_conversions=True, grads_in_place=True):
            assert m.step_state is None and m.w1.weight.grad is None


# ---------------------------------------------------------------- stale cases

@pytest.mark.parametrize("write", ["add_", "copy_", "optimizer", "data"])
def test_writes_between_steps_are_seen_by_the_next_steps_conversions(monkeypatch, write):
    """A weight written between optimizer steps (in place, a checkpoint load's copy_, the
    optimizer, a `.data =` swap): the next step converts the new weights, its outputs those of the
    op without a state."""
    from model.ffn import srelu24_step

    _cpu_kernel_path(monkeypatch, "rowwise", True)
    torch.manual_seed(4)
    w1, w2 = torch.randn(64, 64) / 8, torch.randn(64, 64) / 8
    m = _module(w1, w2, "rowwise", "cpu")
    x, dy = _batches(64, 64, "cpu", n=1)[0]
    with srelu24_step(m, keep_conversions=True, grads_in_place=False):
        m(x).backward(dy)
    with torch.no_grad():
        p = m.w1.weight
        if write == "add_":
            p.add_(0.5)
        elif write == "copy_":
            p.copy_(torch.randn_like(p))
        elif write == "optimizer":
            torch.optim.SGD([p], lr=10.0).step()
        else:
            p.data = torch.randn_like(p)
    with srelu24_step(m, keep_conversions=True, grads_in_place=False):
        got = m(x)
    assert torch.equal(got, m(x))  # no state: every weight converted at its use


def test_a_write_during_the_step_is_refused_at_its_end(monkeypatch):
    from model.ffn import srelu24_step

    _cpu_kernel_path(monkeypatch, "rowwise", True)
    m = _module(torch.randn(64, 64) / 8, torch.randn(64, 64) / 8, "rowwise", "cpu")
    with pytest.raises(RuntimeError, match="written during an optimizer step"):
        with srelu24_step(m, keep_conversions=True, grads_in_place=False):
            assert m.step_state is not None and m.step_state.weights is not None
            with torch.no_grad():
                m.w2.weight.mul_(2)
    assert m.step_state is None


@pytest.mark.parametrize("tokens_permuted", [False, True])
def test_the_compiled_module_takes_each_steps_state_without_recompiling(monkeypatch, tokens_permuted):
    """torch.compile (aot_eager, one graph) around the module, also as the block calls it (tokens
    already permuted): graphs with a step state (a step's first micro-batch, with no .grad to add
    into yet, and the later ones, with it) and one without, and new states on later steps reuse
    them (no recompilation per step). torch 2.13 traces these calls whole; the GPU test of compiled
    training counts graph breaks under the GPU's torch (2.11's dynamo broke the block where its call
    built an options object)."""
    from torch._dynamo.utils import counters

    _cpu_kernel_path(monkeypatch, "rowwise", True)
    torch._dynamo.reset()
    counters.clear()
    m = _module(torch.randn(64, 64) / 8, torch.randn(64, 64) / 8, "rowwise", "cpu")
    fwd = torch.compile(m, backend="aot_eager", fullgraph=True)
    from model.ffn import srelu24_step

    x = _batches(64, 64, "cpu", n=1)[0][0]
    for _ in range(3):
        with srelu24_step(m, keep_conversions=True, grads_in_place=True):
            for _ in range(2):  # the first micro-batch without .grad to add into, the second with it
                fwd(x.clone().requires_grad_(), tokens_permuted=tokens_permuted).float().sum().backward()
        m.zero_grad(set_to_none=True)
        fwd(x, tokens_permuted=tokens_permuted)  # outside a step
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


def test_tokens_the_block_permuted_reach_the_op_as_no_permutation_of_its_own(monkeypatch):
    """The recipe permutes tokens; where the block has done so (tokens_permuted) the op is told not
    to draw an order of its own, else it is told to."""
    import srelu24_kernels.srelu24.op as op

    _cpu_kernel_path(monkeypatch, "rowwise", False)
    seen, real = [], op.ffn_forward
    monkeypatch.setattr(op, "ffn_forward", lambda *a: seen.append(a[9]) or real(*a))  # a[9]: token_permutation
    m = _module(torch.randn(64, 64) / 8, torch.randn(64, 64) / 8, "rowwise", "cpu")
    m.options = replace(m.options, recipe=SReLU24Recipe(token_permutation=True))
    x = _batches(64, 64, "cpu", n=1)[0][0]
    m(x, tokens_permuted=True)
    m(x)
    assert seen == [False, True]


# ---------------------------------------------------------------- what train_step opens

def _recorded_scopes(monkeypatch, parts_and_batches) -> list:
    import training.step as step

    seen, real = [], step.srelu24_step

    def recording(model, keep_conversions, grads_in_place):
        seen.append((keep_conversions, grads_in_place))
        return real(model, keep_conversions, grads_in_place)

    monkeypatch.setattr(step, "srelu24_step", recording)
    for parts, data in parts_and_batches:
        step.train_step(parts, step.TrainState(), data)
    return seen


def test_the_step_shares_state_only_across_several_micro_batches(monkeypatch):
    from test_step import batches, parts_for, tiny

    runs = [(parts_for(tiny("srelu24"), accum=a), iter(batches(a, 4)).__next__) for a in (1, 2)]
    assert _recorded_scopes(monkeypatch, runs) == [(False, False), (True, True)]


def test_under_ddp_the_step_keeps_conversions_but_leaves_accumulation_to_autograd(monkeypatch, tmp_path):
    """DDP's reducer hooks autograd's accumulation, which the op would bypass (one gloo process)."""
    import torch.distributed as dist
    from test_step import batches, parts_for, tiny
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        model = tiny("srelu24")
        parts = replace(parts_for(model, accum=2), train_module=DDP(model))
        assert _recorded_scopes(monkeypatch, [(parts, iter(batches(2, 4)).__next__)]) == [(True, False)]
    finally:
        dist.destroy_process_group()


def test_under_fsdp2_the_step_shares_nothing(monkeypatch, tmp_path):
    """FSDP2 gathers its weights for each use and frees them: nothing is kept (one gloo process)."""
    import torch.distributed as dist
    from test_step import batches, parts_for, tiny
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        model = tiny("srelu24")
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        assert _recorded_scopes(monkeypatch, [(parts_for(model, accum=2), iter(batches(2, 4)).__next__)]) == [
            (False, False)]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- on an sm90 GPU: the e4m3 path

@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (cuSPARSELt e4m3)")
@pytest.mark.parametrize("float8, compiled", [("rowwise", True), ("tensorwise", False), ("rowwise", False)])
def test_the_step_state_gives_autograds_steps_on_cuda(monkeypatch, float8, compiled):
    """The e4m3 op on sm90 (all six GEMMs in float8) in the model's module, compiled as the trainer
    compiles it: 4 weight conversions per optimizer step with the state (W1 rows, W2 rows, W2
    columns, W1 columns), 4 per micro-batch without, gradients added into .grad, and two AdamW
    steps over three micro-batches bit for bit the same."""
    from srelu24_kernels.float8 import paired as fp8_paired
    calls = []
    real_dense, real_sparse, real_paired = fp8_gemm.b_operand, fp8_sparse.kmajor_e4m3, fp8_paired.paired_casts
    monkeypatch.setattr(fp8_gemm, "b_operand", lambda b, r: calls.append(b.dtype) or real_dense(b, r))
    monkeypatch.setattr(fp8_sparse, "kmajor_e4m3", lambda b: calls.append(b.dtype) or real_sparse(b))
    # two conversions a call (tensorwise's kept weights, dY)
    monkeypatch.setattr(fp8_paired, "paired_casts",
                        lambda w, *a, **k: calls.extend([w.dtype] * 2) or real_paired(w, *a, **k))
    torch.manual_seed(5)
    T, d, F_ = 512, 256, 1024
    w1, w2 = torch.randn(F_, d, device="cuda") * d ** -0.5, torch.randn(d, F_, device="cuda") * F_ ** -0.5
    batches = _batches(T, d, "cuda", seed=6)
    fresh = _steps(_module(w1, w2, float8, "cuda"), batches, 2, False, False, compiled)
    assert calls.count(torch.float32) == 4 * 3 * 2  # x and dY's conversions are bf16
    calls.clear()
    torch._dynamo.reset()
    kept = _steps(_module(w1, w2, float8, "cuda"), batches, 2, True, True, compiled)
    assert calls.count(torch.float32) == 4 * 2
    _assert_same(kept, fresh)


# ---------------------------------------------------------------- memory

def test_the_memory_estimate_counts_the_kept_conversions_under_accumulation():
    from model import FFNConfig, ModelConfig, ffn_hidden_dim
    from training.config import Float8, Strategy, TrainerConfig
    from training.memory import KEPT_CONVERSIONS, estimate

    m = ModelConfig(name="7b", dim=4096, n_layers=8, n_heads=32, swiglu_hidden=11008)
    f = FFNConfig(kind="srelu24")
    accum = TrainerConfig(seq_len=4096, batch_size=8, micro_batch_size=2, float8=Float8.rowwise)
    e = estimate(m, f, 32000, accum)
    assert e.parts[KEPT_CONVERSIONS] == 4 * m.dim * ffn_hidden_dim(m, f) * m.n_layers  # 4 e4m3 copies of d x F
    assert 2.1e9 < e.parts[KEPT_CONVERSIONS] < 2.2e9  # 270 MB per 7B layer
    assert e.peak == estimate(m, replace(f, sparse_float8=False), 32000, accum).peak + e.parts[KEPT_CONVERSIONS]
    for other in (replace(accum, batch_size=2), replace(accum, float8=Float8.none),
                  replace(accum, strategy=Strategy.fsdp)):
        assert KEPT_CONVERSIONS not in estimate(m, f, 32000, other).parts
    assert KEPT_CONVERSIONS not in estimate(m, replace(f, sparse_float8=False), 32000, accum).parts
    assert KEPT_CONVERSIONS not in estimate(m, FFNConfig(kind="srelu"), 32000, accum).parts


def test_the_step_keeps_conversions_where_conversions_kept_says(monkeypatch):
    import training.step as step
    from test_step import batches, parts_for, tiny

    asked = []
    monkeypatch.setattr(step, "conversions_kept", lambda model, several: asked.append(several) or True)
    runs = [(parts_for(tiny("srelu24"), accum=1), iter(batches(1, 4)).__next__)]
    assert _recorded_scopes(monkeypatch, runs) == [(True, False)] and asked == [False]


def test_tensorwise_keeps_the_conversions_of_one_micro_batch_too():
    """Two passes over each weight make all four conversions under tensorwise
    (srelu24_kernels/float8/paired.py), fewer than the op's one-by-one conversions at each use:
    kept with one micro-batch too; rowwise and bf16 keep them across several only."""
    from torch import nn

    from model.ffn import SReLU24, conversions_kept
    from srelu24_kernels.srelu24.options import OpOptions

    def model(float8):
        return nn.Sequential(SReLU24(64, 64, OpOptions(float8=float8)), nn.Linear(4, 4))

    assert conversions_kept(model("tensorwise"), several=False)
    assert not conversions_kept(model("rowwise"), several=False) and conversions_kept(model("rowwise"), several=True)
    assert not conversions_kept(model("none"), several=False)
    assert not conversions_kept(nn.Linear(4, 4), several=False)


def test_the_memory_estimate_counts_tensorwises_kept_conversions_with_one_micro_batch():
    from model import FFNConfig, ModelConfig
    from training.config import Float8, TrainerConfig
    from training.memory import KEPT_CONVERSIONS, estimate

    m = ModelConfig(name="1b", dim=2048, n_layers=20, n_heads=16, swiglu_hidden=5632)
    one = TrainerConfig(seq_len=2048, batch_size=8, micro_batch_size=8, float8=Float8.tensorwise)
    assert KEPT_CONVERSIONS in estimate(m, FFNConfig(kind="srelu24"), 32000, one).parts
    assert KEPT_CONVERSIONS not in estimate(m, FFNConfig(kind="srelu24"), 32000, replace(one, float8=Float8.rowwise)).parts
