"""ffn.paired_grad_unscaling: srelu24's e4m3 weight gradients unscaled two micro-batches at a time
(srelu24_kernels/srelu24/op.py, _paired_weight_grads). The unscaling pass with a kept product
against two passes (CPU: TRITON_INTERPRET), and the module over a step's micro-batches against the
unpaired op, bit for bit: even and odd numbers of micro-batches, with and without a .grad there
at the step's start, eager and compiled; where it pairs and where not."""
import pytest
import torch

from helpers import cpu_scaled_mm_runs
from srelu24_kernels.cusparselt.layout import decompress_e4m3, e4m3_metadata
from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.options import OpOptions
from srelu24_kernels.srelu24.reference import SReLU24Recipe
from srelu24_kernels.srelu24.sparsify_backward import dense_slots

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _product(g, m: int, n: int, k: int, dense: bool):
    """A bf16 product [m, n] as the GEMM writes it, power-of-2 row and column scales, and dense columns."""
    y = (torch.randn(m, n, generator=g) * 8).bfloat16().to(DEV)
    sr = torch.exp2(torch.randint(-4, 5, (m,), generator=g).float()).to(DEV)
    sc = torch.exp2(torch.randint(-4, 5, (n,), generator=g).float()).to(DEV)
    cols = None
    if dense:
        which = torch.randperm(n, generator=g)[:k].to(DEV)
        cols = (dense_slots(which, n, DEV)[0], torch.randn(k, m, generator=g).bfloat16().to(DEV))
    return fp8_sparse.Pending(y, sr, sc, cols)


@pytest.mark.parametrize("dense0, dense1", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("into", [False, True])
def test_one_pass_over_two_products_is_two_passes_bit_for_bit(dense0, dense1, into):
    g = torch.Generator().manual_seed(3)
    m, n = 64, 256
    first, second = _product(g, m, n, 5, dense0), _product(g, m, n, 7, dense1)
    grad = torch.randn(m, n, generator=g).to(DEV) if into else None

    def unscaled(p, acc):
        return fp8_sparse.unscale(p.y, row_scale=p.row_scale, col_scale=p.col_scale, out_dtype=torch.float32,
                                  dense_columns=p.dense_columns, accumulate_into=acc)

    want = unscaled(second, unscaled(first, None if grad is None else grad.clone()))
    got = fp8_sparse.unscale(second.y, row_scale=second.row_scale, col_scale=second.col_scale, out_dtype=torch.float32,
                             dense_columns=second.dense_columns, accumulate_into=grad, pending=first)
    assert torch.equal(got, want)
    assert got is grad or grad is None


def test_a_kept_product_of_another_shape_or_into_bf16_is_refused():
    g = torch.Generator().manual_seed(4)
    p, q = _product(g, 64, 128, 0, False), _product(g, 64, 256, 0, False)
    with pytest.raises(ValueError, match="pending product must be"):
        fp8_sparse.unscale(q.y, row_scale=q.row_scale, col_scale=q.col_scale, out_dtype=torch.float32, pending=p)
    with pytest.raises(ValueError, match="pending product must be"):
        fp8_sparse.unscale(p.y, row_scale=p.row_scale, col_scale=p.col_scale, out_dtype=torch.bfloat16, pending=p)


# ---------------------------------------------------------------- the module over micro-batches

def _e4m3_path_on_the_cpu(monkeypatch) -> None:
    """The op's tensorwise e4m3 path on the CPU: conversions and unscaling passes interpreted, the
    dense float8 GEMMs on the CPU's _scaled_mm, cuSPARSELt stood in for (its e4m3 product: the kept
    values multiplied in fp32 and rounded to bf16, as the GEMM writes them)."""
    import model.ffn as ffn
    from test_kernels import _cslt_stand_in

    if not cpu_scaled_mm_runs("tensorwise") or not cpu_scaled_mm_runs("rowwise"):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run these float8 GEMMs (torch 2.13 does)")
    _cslt_stand_in(monkeypatch)
    monkeypatch.setattr(ffn, "kernels_available", lambda x: True)
    monkeypatch.setattr(fp8_sparse, "available", lambda device: True)

    def e4m3_mm(a8, b8, alg, transpose_result=False, out=None):
        y = (decompress_e4m3(a8, a8.shape[0], b8.shape[0]).float() @ b8.float()).bfloat16()
        y = y.t().contiguous() if transpose_result else y
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(fp8_sparse, "cached_mm", e4m3_mm)
    monkeypatch.setattr(fp8_sparse, "searched_alg", lambda a, b, transpose_result=False: 0)
    # interpreted, this one kernel took three quarters of these tests' time (a program per row);
    # its PyTorch reference gives the same bytes (test_the_cpu_stand_in_of_compressed_to_e4m3_is_the_kernel)
    monkeypatch.setattr(fp8_sparse, "compressed_to_e4m3", compressed_to_e4m3_reference)


def compressed_to_e4m3_reference(buf: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_sparse.compressed_to_e4m3 in PyTorch: the value rows scaled and cast as rows_to_e4m3_reference
    does, the bf16 metadata words permuted into the e4m3 layout's (e4m3_metadata)."""
    flat, values = buf.reshape(-1), m * k // 2
    v8, scale = fp8_sparse.rows_to_e4m3_reference(flat[:values].view(m, k // 2))
    meta = e4m3_metadata(flat[values:values + m * k // 16], m, k)
    return torch.cat([v8.view(torch.uint8).reshape(-1), meta]).view(torch.float8_e4m3fn).view(m, -1), scale


def test_the_cpu_stand_in_of_compressed_to_e4m3_is_the_kernel():
    """A compressed bf16 2:4 matrix (test_fp8_sparse's: rows of very different magnitudes, an
    all-zero row, subnormals) as the kernel converts it, byte for byte, scales included."""
    from srelu24_kernels.cusparselt.layout import compress
    from test_fp8_sparse import sparse_bf16

    m, k = 64, 128
    a, keep = sparse_bf16(m, k, 8)
    buf = compress(a, keep).to(DEV)
    got, want = compressed_to_e4m3_reference(buf.cpu(), m, k), fp8_sparse.compressed_to_e4m3(buf, m, k)
    assert torch.equal(got[1], want[1].cpu())
    assert torch.equal(got[0].view(torch.uint8), want[0].cpu().view(torch.uint8))


def _module(w1, w2, paired: bool):
    from model.ffn import SReLU24

    m = SReLU24(w1.shape[1], w1.shape[0], OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise"),
                paired_grad_unscaling=paired)
    m.w1.weight.data, m.w2.weight.data = w1.clone(), w2.clone()
    m.set_2to4(True)
    return m


def _step(m, batches, fwd=None, grads_there: bool = False) -> tuple:
    """One step's micro-batches inside srelu24_step (gradients in place), advanced as train_step
    does: (.grad of W1, W2 after the step, whether the step state had paired buffers)."""
    from model.ffn import srelu24_step

    fwd = fwd if fwd is not None else m
    if grads_there:  # not zeros: adding into them in another order would show
        g = torch.Generator().manual_seed(9)
        m.w1.weight.grad, m.w2.weight.grad = torch.randn(m.w1.weight.shape, generator=g), torch.randn(m.w2.weight.shape,
                                                                                                    generator=g)
    with srelu24_step(m, keep_conversions=True, grads_in_place=True) as micro_batches:
        paired = m.step_state is not None and m.step_state.pairs is not None
        for x, dy in batches:
            fwd(x.clone().requires_grad_()).backward(dy)
            micro_batches.advance()
    return m.w1.weight.grad.clone(), m.w2.weight.grad.clone(), paired


def _batches(n: int, T: int = 64, d: int = 64, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, d, generator=g).bfloat16(), torch.randn(T, d, generator=g).bfloat16()) for _ in range(n)]


def _weights(seed: int = 6, d: int = 64, f: int = 128):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(f, d, generator=g) / 8, torch.randn(d, f, generator=g) / 11


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("grads_there", [False, True])
def test_paired_gradients_are_the_unpaired_ones_bit_for_bit(monkeypatch, n, grads_there):
    """Two, three and four micro-batches (the third of three kept, added when the step ends), with no
    .grad at the step's start (the first pair makes it) or one kept between steps; the dense features
    (5% of 128: 6) in every micro-batch."""
    _e4m3_path_on_the_cpu(monkeypatch)
    w1, w2 = _weights()
    batches = _batches(n)
    *got, paired = _step(_module(w1, w2, True), batches, grads_there=grads_there)
    *want, unpaired = _step(_module(w1, w2, False), batches, grads_there=grads_there)
    assert paired and not unpaired
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_first_of_a_pair_adds_nothing_and_the_second_adds_both(monkeypatch):
    """After the first micro-batch there is no .grad yet; after the second it holds both."""
    from model.ffn import srelu24_step

    _e4m3_path_on_the_cpu(monkeypatch)
    w1, w2 = _weights()
    m = _module(w1, w2, True)
    (x0, dy0), (x1, dy1) = _batches(2)
    with srelu24_step(m, keep_conversions=True, grads_in_place=True) as micro_batches:
        m(x0.clone().requires_grad_()).backward(dy0)
        micro_batches.advance()
        assert m.w1.weight.grad is None and m.w2.weight.grad is None
        m(x1.clone().requires_grad_()).backward(dy1)
        micro_batches.advance()
        assert m.w1.weight.grad is not None and m.step_state.grads == (m.w1.weight.grad, m.w2.weight.grad)
    assert m.step_state is None


def test_compiled_paired_steps_are_the_eager_ones_and_compile_once_per_half_of_a_pair(monkeypatch):
    """torch.compile (aot_eager, one graph): two steps of four micro-batches give the eager module's
    gradients; the graphs are those of a pair's first and second micro-batch, with no .grad yet and
    with it, reused on the next step."""
    from torch._dynamo.utils import counters

    _e4m3_path_on_the_cpu(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    w1, w2 = _weights()
    batches = _batches(4)
    m, ref = _module(w1, w2, True), _module(w1, w2, False)
    fwd = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        got = _step(m, batches, fwd)
        want = _step(ref, batches)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


@pytest.mark.parametrize("compiled", [False, True])
def test_checkpointed_paired_steps_are_the_unpaired_ones(monkeypatch, compiled):
    """Under activation checkpointing (training/distributed.py's, as the trainer applies it to a block;
    compiled: dynamo's checkpoint operator, aot_eager), a recomputed forward reads the same half of
    its pair: steps of four micro-batches give the unpaired eager module's gradients, bit for bit."""
    import functools

    from training.distributed import checkpointed

    class Block(torch.nn.Module):  # what checkpointed reads of a block: its feed_forward
        def __init__(self, ffn):
            super().__init__()
            self.feed_forward = ffn

        def forward(self, x):
            return self.feed_forward(x)

    _e4m3_path_on_the_cpu(monkeypatch)
    torch._dynamo.reset()
    w1, w2 = _weights()
    batches = _batches(4)
    m, ref = _module(w1, w2, True), _module(w1, w2, False)
    block = Block(m)
    block.forward = functools.partial(checkpointed, block.forward)
    fwd = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block
    for _ in range(2 if compiled else 1):  # compiled: the second step reuses the graphs
        got = _step(m, batches, fwd)
        want = _step(ref, batches)
        assert got[2] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_no_pairs_without_the_switch_without_several_micro_batches_or_outside_tensorwise(monkeypatch):
    from model.ffn import srelu24_step

    _e4m3_path_on_the_cpu(monkeypatch)
    w1, w2 = _weights()
    m = _module(w1, w2, True)
    with srelu24_step(m, keep_conversions=True, grads_in_place=False):  # one micro-batch, or DDP / FSDP2
        assert m.step_state is None or m.step_state.pairs is None
    rowwise = _module(w1, w2, True)
    rowwise.options = OpOptions(SReLU24Recipe(token_permutation=False), "rowwise")
    with srelu24_step(rowwise, keep_conversions=True, grads_in_place=True):
        assert rowwise.step_state is None or rowwise.step_state.pairs is None
    with srelu24_step(m, keep_conversions=True, grads_in_place=True):
        assert m.step_state.pairs is not None and m.step_state.pairs.y1.shape == (128, 64)
    assert m.step_state is None


def test_a_grad_of_one_weight_only_is_not_paired(monkeypatch):
    """A .grad the step cannot take (W1's only) would get the first pair's sum added by autograd in
    another order: such a step does not pair, and its gradients are the unpaired op's."""
    from model.ffn import srelu24_step

    _e4m3_path_on_the_cpu(monkeypatch)
    w1, w2 = _weights()
    m = _module(w1, w2, True)
    m.w1.weight.grad = torch.randn(m.w1.weight.shape)
    with srelu24_step(m, keep_conversions=True, grads_in_place=True):
        assert m.step_state.pairs is None


def test_a_micro_batch_the_op_cannot_pair_is_refused_in_one_line(monkeypatch):
    """Tokens not a multiple of 64 (the e4m3 layout): the backward says what to set, rather than
    leaving a kept product without its pair."""
    from model.ffn import srelu24_step

    _e4m3_path_on_the_cpu(monkeypatch)
    w1, w2 = _weights()
    m = _module(w1, w2, True)
    x, dy = _batches(1, T=96)[0]
    with pytest.raises(ValueError, match="set ffn.paired_grad_unscaling=false"):
        with srelu24_step(m, keep_conversions=True, grads_in_place=True):
            m(x.clone().requires_grad_()).backward(dy)


def test_the_config_check_refuses_micro_batches_the_op_cannot_pair():
    from helpers import compose_config, to_object
    from training.config_checks import check_config
    from training.errors import ConfigError

    ok = ["ffn=srelu24", "trainer.float8=tensorwise", "trainer.micro_batch_size=2", "trainer.batch_size=4"]
    check_config(to_object(compose_config(ok + ["trainer.seq_len=96"])))  # 192 tokens
    with pytest.raises(ConfigError) as e:
        check_config(to_object(compose_config(ok + ["trainer.seq_len=100"])))
    assert "ffn.paired_grad_unscaling=true needs the tokens of a micro-batch" in str(e.value) and "\n" not in str(e.value)
    # where it would not pair (no accumulation, other GEMMs, no kernels, switched off) they run
    for other in (["trainer.batch_size=2"], ["trainer.float8=none"], ["trainer.float8=rowwise"], ["ffn.kernels=false"],
                  ["ffn.sparse_float8=false"], ["ffn.paired_grad_unscaling=false"]):
        check_config(to_object(compose_config(ok + ["trainer.seq_len=100"] + other)))
    with pytest.raises(ConfigError):  # a graphed step pairs too
        check_config(to_object(compose_config(ok + ["trainer.seq_len=100", "trainer.cuda_graph=true"])))


def test_the_switch_reaches_the_module_from_the_config():
    from model.config import FFNConfig
    from model.ffn import SReLU24

    assert SReLU24.from_config(64, 128, FFNConfig(kind="srelu24")).paired_grad_unscaling  # on by default
    assert not SReLU24.from_config(64, 128, FFNConfig(kind="srelu24", paired_grad_unscaling=False)).paired_grad_unscaling


# ---------------------------------------------------------------- on an sm90 GPU: cuSPARSELt's products

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (cuSPARSELt e4m3)")
@pytest.mark.parametrize("n, compiled", [(3, False), (4, True)])
def test_paired_gradients_on_the_gpu_are_the_unpaired_ones_bit_for_bit(n, compiled):
    """The tensorwise e4m3 op on sm90 in the model's module (bf16 autocast; compiled as the trainer
    compiles it): the step's dW1 and dW2 bit for bit the same, paired or not."""
    from model.ffn import SReLU24, srelu24_step

    torch.manual_seed(5)
    T, d, F_ = 512, 256, 1024
    w1, w2 = torch.randn(F_, d, device="cuda") * d ** -0.5, torch.randn(d, F_, device="cuda") * F_ ** -0.5
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(T, d, generator=g).bfloat16().cuda(), torch.randn(T, d, generator=g).bfloat16().cuda())
               for _ in range(n)]
    out = []
    for paired in (True, False):
        m = SReLU24(d, F_, OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise"),
                    paired_grad_unscaling=paired).cuda()
        m.w1.weight.data, m.w2.weight.data = w1.clone(), w2.clone()
        m.set_2to4(True)
        fwd = torch.compile(m) if compiled else m
        with srelu24_step(m, keep_conversions=True, grads_in_place=True) as micro_batches:
            assert (m.step_state.pairs is not None) == paired
            for x, dy in batches:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fwd(x.clone().requires_grad_())
                y.backward(dy)
                micro_batches.advance()
        out.append((m.w1.weight.grad, m.w2.weight.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_the_memory_estimate_counts_the_kept_products():
    from dataclasses import replace

    from model import FFNConfig, ModelConfig, ffn_hidden_dim
    from training.config import Float8, Strategy, TrainerConfig
    from training.memory import PAIRED_PRODUCTS, estimate

    m = ModelConfig(name="7b", dim=4096, n_layers=8, n_heads=32, swiglu_hidden=11008)
    f = FFNConfig(kind="srelu24", paired_grad_unscaling=True)
    accum = TrainerConfig(seq_len=4096, batch_size=16, micro_batch_size=2, float8=Float8.tensorwise)
    e = estimate(m, f, 32000, accum)
    assert e.parts[PAIRED_PRODUCTS] == 2 * 2 * m.dim * ffn_hidden_dim(m, f) * m.n_layers  # dW1, dW2 in bf16
    assert e.peak == estimate(m, replace(f, paired_grad_unscaling=False), 32000, accum).peak + e.parts[PAIRED_PRODUCTS]
    for other in (replace(accum, batch_size=2), replace(accum, float8=Float8.rowwise),
                  replace(accum, strategy=Strategy.fsdp)):
        assert PAIRED_PRODUCTS not in estimate(m, f, 32000, other).parts
    # a graphed step pairs too (training/cuda_graph.py: one graph per half of a pair)
    assert estimate(m, f, 32000, replace(accum, cuda_graph=True)).parts[PAIRED_PRODUCTS] == e.parts[PAIRED_PRODUCTS]
    assert PAIRED_PRODUCTS not in estimate(m, replace(f, paired_grad_unscaling=False), 32000, accum).parts
