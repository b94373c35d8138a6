"""srelu24's op inside a compiled graph hands Y and dX out still scaled (op._defers_unscaling), and
the unscaling runs as torch ops that Inductor fuses into their readers: the same bits as the op's own
unscaling pass, eager."""
import pytest
import torch

from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.options import OpOptions
from srelu24_kernels.srelu24.reference import SReLU24Recipe


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _pow2_scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's kernel on CPU tensors (the GPU test below "
                    "covers the GPU's)")
def test_unscaled_in_torch_ops_is_the_unscaling_kernel_bit_for_bit():
    """Fresh random products, power-of-2 scales (a NaN among them, as a NaN row gives): the torch
    expression and the Triton pass write the same bf16 bits."""
    for seed, (m, n) in enumerate([(64, 128), (100, 48), (1, 3)]):
        g = torch.Generator().manual_seed(seed)
        y = (torch.randn(m, n, generator=g) * 2.0 ** torch.randint(-30, 30, (m, 1), generator=g)).bfloat16()
        rows, cols = _pow2_scales(m, seed + 10), _pow2_scales(n, seed + 20)
        rows[0] = float("nan")
        want = fp8_sparse.unscale_(y.clone(), row_scale=rows, col_scale=cols)
        got = fp8_sparse.unscaled(y, rows, cols)
        assert torch.equal(_bits(got)[1:], _bits(want)[1:]) and got[0].isnan().all() and want[0].isnan().all()


def test_the_op_defers_where_asked_and_its_products_are_e4m3(monkeypatch):
    """op._defers_unscaling: asked (compiled), e4m3 2:4 GEMMs that fp8_sparse.usable takes (granted
    here, on fake-shaped stand-ins), and for dX a 2:4 dZ in the tokens' own order."""
    import srelu24_kernels.srelu24.op as K
    monkeypatch.setattr(fp8_sparse, "usable", lambda a, b: a.shape[1] * 16 == b.shape[0] * 9)
    a, b = K._compressed_like(torch.empty(100, 8), 256), torch.empty(256, 64)
    assert a.shape == (128, 144) and a.dtype == torch.bfloat16  # the rows padded to 64
    tensorwise = OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise", True)
    assert K._defers_unscaling(a, b, tensorwise, True) and K._defers_unscaling(a, b, tensorwise, True, True)
    assert not K._defers_unscaling(a, b, tensorwise, False)                                         # not asked (eager)
    assert not K._defers_unscaling(a, b[:192], tensorwise, True)                                    # not usable
    assert not K._defers_unscaling(a, b, OpOptions(SReLU24Recipe(), "tensorwise", False), True)     # bf16 2:4 GEMMs
    assert not K._defers_unscaling(a, b, OpOptions(SReLU24Recipe(), "none"), True)
    rowwise = OpOptions(SReLU24Recipe(token_permutation=False), "rowwise", True)
    assert K._defers_unscaling(a, b, rowwise, True, backward=True)
    drawn = OpOptions(SReLU24Recipe(token_permutation=True), "tensorwise", True)  # the op gathers dX's rows back
    assert K._defers_unscaling(a, b, drawn, True) and not K._defers_unscaling(a, b, drawn, True, True)
    dense_dx = OpOptions(SReLU24Recipe(False, 0.05, reuse_forward_mask=False), "tensorwise", True)
    assert K._defers_unscaling(a, b, dense_dx, True) and not K._defers_unscaling(a, b, dense_dx, True, True)
    monkeypatch.undo()
    assert not K._defers_unscaling(a, b, tensorwise, True)  # CPU tensors: fp8_sparse.usable says no


def _scaled_stand_in(monkeypatch) -> list:
    """fp8_sparse.scaled_sparse_mm on the CPU: the e4m3 reference product times power-of-2 row and
    column scales, as cuSPARSELt's product comes out before its unscaling. Records its calls."""
    from test_paired_casts import _e4m3_sparse_stand_in

    _e4m3_sparse_stand_in(monkeypatch)
    calls = []

    def scaled_sparse_mm(buf, b, b_e4m3=None):
        b = b if b_e4m3 is None else b_e4m3[0].float() / b_e4m3[1][None, :]
        y = fp8_sparse.sparse_mm_reference(buf, b)
        # seeded by B (W2^T for Y, W1 for dX: other scales, so that a mix-up shows), the same for the same B
        seed = int(b.float().abs().sum().item() * 1000) % 2**31
        rows, cols = _pow2_scales(y.shape[0], seed), _pow2_scales(y.shape[1], seed + 1)
        calls.append(tuple(y.shape))
        return (y.float() * rows[:, None] * cols[None, :]).bfloat16(), rows, cols

    monkeypatch.setattr(fp8_sparse, "scaled_sparse_mm", scaled_sparse_mm)
    return calls


def _runs(ffn, x, w1, w2, dy) -> list:
    for t in (x, w1, w2):
        t.grad = None
    y = ffn(x, w1, w2)
    y.backward(dy)
    return [y.detach().clone()] + [t.grad.clone() for t in (x, w1, w2)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: on a GPU machine the granted sm90 kernels would "
                    "launch on CPU tensors (the GPU test below covers the op there)")
@pytest.mark.parametrize("tokens, recipe, step", [(128, "tensorwise", False), (100, "tensorwise", False),
                                                  (128, "tensorwise", True), (100, "rowwise", True)])
def test_compiled_the_op_defers_y_and_dx_and_gives_eagers_bits(monkeypatch, tokens, recipe, step):
    """The float8 op on the CPU (cuSPARSELt stood in for, the e4m3 2:4 GEMMs by their references,
    the sm90 conversions granted), compiled in one graph: its forward and backward each hand out a
    still-scaled product, and Y, dX, dW1, dW2 are eager's bit for bit; also for tokens not a
    multiple of 64 and with an optimizer step's state (kept weight conversions, gradients added
    into given buffers)."""
    from helpers import cpu_op_inputs, cpu_scaled_mm_runs
    from test_kernels import _cslt_stand_in
    from srelu24_kernels.srelu24.op import convert_weights, ffn
    from srelu24_kernels.srelu24.options import StepState
    if not cpu_scaled_mm_runs(recipe):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run {recipe}")
    _cslt_stand_in(monkeypatch)
    calls = _scaled_stand_in(monkeypatch)
    monkeypatch.setattr(fp8_sparse, "available", lambda device: True)
    x, w1, w2, dy = cpu_op_inputs(tokens, 21)
    options = OpOptions(SReLU24Recipe(token_permutation=False), recipe, True)

    def run(fn) -> list:
        for t in (x, w1, w2):
            t.grad = None
        state = None
        if step:
            state = StepState(convert_weights(w1.detach(), w2.detach(), options),
                              (torch.zeros_like(w1), torch.zeros_like(w2)))
        y = fn(x, w1, w2, state)
        y.backward(dy)
        grads = state.grads if step else (w1.grad, w2.grad)
        return [y.detach().clone(), x.grad.clone()] + [t.clone() for t in grads]

    def op(xx, a, b, state):
        return ffn(xx, a, b, options, None, state)

    want = run(op)
    assert calls == []  # eager: the op unscales itself
    torch._dynamo.reset()
    got = run(torch.compile(op, backend="aot_eager", fullgraph=True))
    assert calls == [(128, 64), (128, 64)]  # Y's product in the forward, dX's in the backward (rows padded to 64)
    for what, a, b in zip(("Y", "dX", "dW1", "dW2"), got, want):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), what


def test_the_ops_schema_and_fakes_with_deferred_products(monkeypatch):
    """opcheck of the three ops asked to defer (Y's and dX's ops' fakes' two scale outputs), on
    the CPU path."""
    from helpers import backward_args, cpu_op_inputs, cpu_scaled_mm_runs, forward_args, output_args
    from test_kernels import _cslt_stand_in
    import srelu24_kernels.srelu24.op as K
    if torch.cuda.is_available() or not cpu_scaled_mm_runs("tensorwise"):
        pytest.skip("the CPU path with the CPU's tensorwise _scaled_mm")
    _cslt_stand_in(monkeypatch)
    _scaled_stand_in(monkeypatch)
    monkeypatch.setattr(fp8_sparse, "available", lambda device: True)
    x, w1, w2, dy = cpu_op_inputs(128, 22)
    o = OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise", True)
    args = forward_args(x, w1, w2, False, o, defer_unscaling=True)
    out = K.ffn_forward(*args)
    torch.library.opcheck(K.ffn_forward, args)
    y_args = output_args(out, w2, o, defer_unscaling=True)
    _, rows, cols = K.ffn_output(*y_args)
    assert rows.shape == (128,) and cols.shape == (64,)
    torch.library.opcheck(K.ffn_output, y_args)
    back = backward_args(dy, x.detach(), w1.detach(), w2.detach(), out, o, defer_unscaling=True)
    dx, _, _, rows, cols = K.ffn_backward(*back)
    assert dx.shape == (128, 64) and rows.shape == (128,) and cols.shape == (64,)
    torch.library.opcheck(K.ffn_backward, back)


@pytest.mark.gpu
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_inductor_fuses_the_unscaling_with_eagers_bits_on_the_gpu(monkeypatch, weights_dtype):
    """The tensorwise e4m3 op at the 1B FFN's width, fresh random inputs, compiled by Inductor with a
    residual add after it (where the trainer's block fuses Y's unscaling): Y + x, dX, dW1, dW2 the
    same bits as eager, where the op's own Triton pass unscales; and the compiled op deferred."""
    from helpers import wide_op_inputs
    from srelu24_kernels.srelu24.op import ffn
    if not fp8_sparse.available("cuda"):
        pytest.skip("needs an sm90 GPU with cuSPARSELt's e4m3 kernels")
    calls, real = [], fp8_sparse.scaled_sparse_mm
    monkeypatch.setattr(fp8_sparse, "scaled_sparse_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w1, w2, dy = wide_op_inputs(23, weights_dtype)

    options = OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise", True)  # torch 2.11's dynamo builds none

    def block(xx, a, b):
        return xx + ffn(xx, a, b, options)

    want = _runs(block, x, w1, w2, dy)
    assert calls == []
    torch._dynamo.reset()
    got = _runs(torch.compile(block, fullgraph=True), x, w1, w2, dy)
    assert len(calls) == 2
    for what, a, b in zip(("x + Y", "dX", "dW1", "dW2"), got, want):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), what


def test_whether_a24_is_kept_is_a_constant_to_torch_compile(monkeypatch):
    """a24_usable asks the CUDA library, whose first load (os.path.exists, ctypes) dynamo cannot
    trace: traced, it broke every compiled block at the FFN (and nothing around the op fused).
    Compiled whole (fullgraph) with that load still to come, it is called, not traced."""
    import os

    from srelu24_kernels.srelu24.native import NativeLibrary
    from srelu24_kernels.srelu24.sparsify_backward import a24_usable

    looked = []
    monkeypatch.setattr(NativeLibrary, "available",
                        lambda self, device=None, majors=(9,): looked.append(1) or not os.path.exists("/nonexistent"))

    def f(x):
        return x + 1 if a24_usable(torch.device("cuda", 0), 128, True) else x - 1

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
    assert looked == [1]


@pytest.mark.gpu
def test_the_block_compiles_in_one_graph_before_the_kernels_load():
    """A transformer block with srelu24 in its 2:4 phase (float8 tensorwise, tokens permuted by the
    block), compiled as the trainer compiles it, in a process where the CUDA library has not yet
    been loaded: one graph (fullgraph), forward and backward."""
    from model.config import FFNConfig, ModelConfig
    from model.transformer import Block, rope_tables
    from srelu24_kernels.srelu24.native import KERNELS
    from srelu24_kernels.srelu24.reference import random_token_orders

    if not fp8_sparse.available("cuda"):
        pytest.skip("needs an sm90 GPU with cuSPARSELt's e4m3 kernels")
    torch.manual_seed(24)
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=2, max_seq_len=256)
    block = Block(cfg, FFNConfig(kind="srelu24", hidden_dim=1024), "tensorwise").cuda()
    block.feed_forward.set_2to4(True)
    x = torch.randn(2, 256, 256, device="cuda", requires_grad=True)
    cos, sin = (t.cuda() for t in rope_tables(128, 256, 10000.0))
    order = random_token_orders(512, 1, "cuda")[0]
    KERNELS.loaded.clear()  # as in a fresh process whose first use of the library is traced
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = compiled(x, cos, sin, token_order=order)
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and block.feed_forward.w1.weight.grad is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: on a GPU machine the granted sm90 kernels would "
                    "launch on CPU tensors (the GPU test above compiles a block there)")
def test_inductor_fuses_the_unscaling_into_the_blocks_residual_add_and_norm_backward(monkeypatch):
    """A transformer block with srelu24 in its 2:4 phase (tokens permuted by the block, float8
    tensorwise, the CPU path with stand-ins), compiled by Inductor in one graph: Y's unscaling (the
    division by its scales, [:, None]) runs inside the kernel that adds it to the residual, and dX's
    inside the norm's backward, not in kernels of their own (as when a graph break split the block)."""
    import re

    from torch._inductor.utils import run_and_get_code

    import model.ffn as ffn_module
    from helpers import cpu_scaled_mm_runs
    from model.config import FFNConfig, ModelConfig
    from model.transformer import Block, rope_tables
    from srelu24_kernels.srelu24.reference import random_token_orders
    from test_kernels import _cslt_stand_in
    if not cpu_scaled_mm_runs("tensorwise"):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run tensorwise")
    _cslt_stand_in(monkeypatch)
    calls = _scaled_stand_in(monkeypatch)
    monkeypatch.setattr(fp8_sparse, "available", lambda device: True)
    monkeypatch.setattr(ffn_module, "kernels_available", lambda x: True)
    torch.manual_seed(25)
    block = Block(ModelConfig(dim=128, n_heads=2, max_seq_len=64), FFNConfig(kind="srelu24", hidden_dim=256), "tensorwise")
    block.feed_forward.set_2to4(True)
    x = torch.randn(2, 64, 128, requires_grad=True)
    cos, sin = rope_tables(64, 64, 10000.0)
    order = random_token_orders(128, 1, "cpu")[0]
    compiled = torch.compile(block, fullgraph=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = compiled(x, cos, sin, token_order=order)
        y.float().square().mean().backward()

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    assert len(calls) == 2  # Y and dX left the op scaled
    kernels = {name for code in codes for name in re.findall(r"\b((?:cpp|triton)_\w*fused\w*?)(?:_\d+)? = ", code)}
    unscaling = [k for k in kernels if "div" in k and "unsqueeze" in k]
    assert len(unscaling) == 2 and all("add" in k for k in unscaling), sorted(kernels)
    assert torch.isfinite(x.grad).all()
