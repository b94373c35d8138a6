"""kernels/grads_in_place.py: srelu24's op adding its fp32 weights' gradients into .grad itself.
The unscaling pass and the dense rows adding instead of writing (CPU: TRITON_INTERPRET), the
parameter lookup, the op against autograd's accumulation over micro-batches (CPU fallbacks, then
on a GPU the e4m3 path compiled), and which models build_model turns it on for."""
import pytest
import torch

from kernels import fp8_sparse, grads_in_place
from kernels.srelu24_sparsify_backward import dense_slots, write_dense_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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


def test_parameter_of_finds_registered_parameters_and_names_the_fix_otherwise():
    p = torch.nn.Parameter(torch.randn(8, 4))
    grads_in_place.register([p])
    assert grads_in_place.parameter_of(p.detach()) is p
    p.data = torch.randn(8, 4)  # a new address (a parameter moved): found again
    assert grads_in_place.parameter_of(p.detach()) is p
    with pytest.raises(RuntimeError, match="grads_in_place: no registered parameter"):
        grads_in_place.parameter_of(torch.randn(8, 4))


def _steps(w1, w2, batches, float8: str, in_place: bool, dev: str, compiled: bool = False) -> list:
    """Three micro-batches into .grad of fp32 parameters, through the model's module in its 2:4 phase
    (bf16 autocast on a GPU), the op adding the gradients itself or autograd: the gradients after
    each micro-batch."""
    from kernels.srelu24_reference import SReLU24Recipe
    from model.ffn import SReLU24

    m = SReLU24(w1.shape[1], w1.shape[0], SReLU24Recipe(token_permutation=False)).to(dev)
    m.w1.weight.data, m.w2.weight.data = w1.clone(), w2.clone()
    m.set_2to4(True)
    m.float8, m.grads_in_place = float8, in_place
    grads_in_place.register(m.parameters())
    fwd = torch.compile(m) if compiled else m
    out = []
    for x, dy in batches:
        x = x.clone().requires_grad_()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            y = fwd(x)
        y.backward(dy)
        out.append([x.grad, m.w1.weight.grad.clone(), m.w2.weight.grad.clone()])
    return out


def _batches(T, d, dev, n=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(T, d, generator=g).bfloat16().to(dev), torch.randn(T, d, generator=g).bfloat16().to(dev))
            for _ in range(n)]


@pytest.mark.parametrize("float8", ["rowwise"])  # tensorwise differs in the dense GEMMs only: the GPU test runs it
def test_the_op_adds_its_gradients_as_autograd_would_on_the_cpu(monkeypatch, float8):
    """The CPU's bf16 2:4 fallbacks (cuSPARSELt stood in for; the kernel path forced): the first
    micro-batch stores dW, the next ones add it, the same as autograd's accumulation bit for bit."""
    import model.ffn as ffn
    from helpers import cpu_scaled_mm_runs
    from test_kernels import _cslt_stand_in

    if not cpu_scaled_mm_runs(float8):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run {float8} (torch 2.13 does)")
    _cslt_stand_in(monkeypatch)
    monkeypatch.setattr(ffn, "kernels_available", lambda x: True)
    torch.manual_seed(2)
    T, d, F_ = 100, 64, 128
    w1, w2 = torch.randn(F_, d) * d ** -0.5, torch.randn(d, F_) * F_ ** -0.5
    batches = _batches(T, d, "cpu")
    added, real = [], grads_in_place.add
    monkeypatch.setattr(grads_in_place, "add", lambda p, dw: added.append(p.grad is None) or real(p, dw))
    got = _steps(w1, w2, batches, float8, True, "cpu")
    assert added == [True, True] + [False, False] * 2  # W1, W2: stored, then added (not by autograd)
    for g, w in zip(got, _steps(w1, w2, batches, float8, False, "cpu")):
        for a, b in zip(g, w):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("float8, compiled", [("rowwise", True), ("tensorwise", False)])
def test_the_e4m3_op_adds_its_gradients_as_autograd_would_on_cuda(float8, compiled):
    """sm90, the e4m3 path: the unscaling pass adds the 2:4 products into .grad (dW2's dense
    columns in it, dW1's dense rows after), compiled as the trainer compiles the blocks: the
    gradients after each of three micro-batches bit for bit autograd's."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU (cuSPARSELt e4m3)")
    torch.manual_seed(3)
    T, d, F_ = 512, 256, 1024
    w1, w2 = torch.randn(F_, d, device="cuda") * d ** -0.5, torch.randn(d, F_, device="cuda") * F_ ** -0.5
    batches = _batches(T, d, "cuda")
    got = _steps(w1, w2, batches, float8, True, "cuda", compiled)
    want = _steps(w1, w2, batches, float8, False, "cuda", compiled)
    for i, (g, w) in enumerate(zip(got, want)):
        for what, a, b in zip(("dX", "dW1", "dW2"), g, w):
            assert torch.equal(a, b), f"micro-batch {i}: {what}"


def test_build_model_turns_it_on_for_one_process():
    from model import FFNConfig, ModelConfig, Transformer
    from model.ffn import SReLU24
    from training.config import TrainerConfig
    from training.distributed import Dist, build_model

    cfg = ModelConfig(name="t", dim=64, n_layers=2, n_heads=2, swiglu_hidden=128, max_seq_len=64)
    t = TrainerConfig(seq_len=64, batch_size=2, micro_batch_size=1, compile=False)
    model, _ = build_model(lambda: Transformer(cfg, FFNConfig(kind="srelu24"), 96), t, Dist(), 0, False)
    ffns = [m for m in model.modules() if isinstance(m, SReLU24)]
    assert len(ffns) == 2 and all(m.grads_in_place for m in ffns)
    assert grads_in_place.parameter_of(ffns[0].w1.weight.detach()) is ffns[0].w1.weight


def test_build_model_leaves_it_off_under_ddp(tmp_path):
    """DDP's reducer hooks autograd's accumulation, which the op would bypass (one gloo process)."""
    from dataclasses import replace

    import torch.distributed as dist

    from model import FFNConfig, ModelConfig, Transformer
    from model.ffn import SReLU24
    from training.config import Strategy, TrainerConfig
    from training.distributed import Dist, build_model

    cfg = ModelConfig(name="t", dim=64, n_layers=2, n_heads=2, swiglu_hidden=128, max_seq_len=64)
    t = TrainerConfig(seq_len=64, batch_size=2, micro_batch_size=1, compile=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        model, wrapped = build_model(lambda: Transformer(cfg, FFNConfig(kind="srelu24"), 96),
                                     replace(t, strategy=Strategy.ddp), Dist(enabled=True), 0, False)
        ffns = [m for m in model.modules() if isinstance(m, SReLU24)]
        assert wrapped is not model and len(ffns) == 2 and not any(m.grads_in_place for m in ffns)
    finally:
        dist.destroy_process_group()
