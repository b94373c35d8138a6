"""A checkpointed srelu24 block (training/distributed.py, checkpointed) recomputes in its backward
the op's forward up to A24 (srelu24::ffn_forward) and not Y's 2:4 GEMM (srelu24::ffn_output): AOT
autograd's partitioner, as Inductor runs it (min_cut_rematerialization_partition), recomputes only
the forward's nodes whose outputs the backward reads, as it leaves W2's GEMM out of the dense FFN's
recomputation. Read off the compiled graphs on the CPU (the op's kernel paths with their stand-ins),
with the gradients those without checkpointing; on a GPU, Inductor's gradients with full
checkpointing those without."""
import functools

import pytest
import torch
from torch import nn

from srelu24_kernels.srelu24.options import OpOptions
from srelu24_kernels.srelu24.reference import SReLU24Recipe


class _Block(nn.Module):
    """What checkpointed reads of a block (its feed_forward), and the residual add that Y's deferred
    unscaling fuses into."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.feed_forward = ffn

    def forward(self, x):
        return x + self.feed_forward(x)


def _module(w1, w2, float8: str, dev: str = "cpu"):
    from model.ffn import SReLU24

    m = SReLU24(w1.shape[1], w1.shape[0], OpOptions(SReLU24Recipe(token_permutation=False), float8)).to(dev)
    m.w1.weight.data, m.w2.weight.data = w1.clone(), w2.clone()
    m.set_2to4(True)
    return m


def _srelu24_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The srelu24 ops a graph calls, by name; a mutating one (the backward) inside its functional wrapper."""
    names = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        op = n.args[0] if isinstance(n.target, torch._ops.HigherOrderOperator) and n.args else n.target
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "srelu24":
            names.append(op._opname)
    return names


def _compiled_run(ffn: nn.Module, x, dy, checkpointing: bool, step: bool = False) -> tuple[dict, list]:
    """The block compiled through AOT autograd with Inductor's partitioner, its graphs run as they are:
    ({"forward": its srelu24 ops, "backward": its srelu24 ops}, [the block's output, dX, dW1, dW2])."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from model.ffn import srelu24_step
    from training.distributed import checkpointed

    ops = {}

    def recording(which):
        def compiler(gm, example_inputs):
            ops[which] = _srelu24_ops(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recording("forward"), bw_compiler=recording("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    block = _Block(ffn)
    if checkpointing:  # as apply_activation_checkpointing does
        block.forward = functools.partial(checkpointed, block.forward)
    fwd = torch.compile(block, backend=backend, fullgraph=True)
    x = x.clone().requires_grad_()
    with srelu24_step(ffn, keep_conversions=step, grads_in_place=False):
        assert (ffn.step_state is not None and ffn.step_state.weights is not None) == step
        y = fwd(x)
        y.backward(dy)
    out = [y.detach(), x.grad, ffn.w1.weight.grad, ffn.w2.weight.grad]
    ffn.zero_grad(set_to_none=True)
    return ops, out


def _kernel_path(monkeypatch, float8: str) -> None:
    """The op's kernel path on the CPU: cuSPARSELt stood in for; with float8 the dense GEMMs on the
    CPU's _scaled_mm, and tensorwise as on an sm90 GPU (e4m3 2:4 GEMMs by their stand-ins, X's and
    dY's casts paired, Y and dX left scaled inside the graph)."""
    import model.ffn as ffn
    from test_kernels import _cslt_stand_in
    from test_paired_grads import _e4m3_path_on_the_cpu
    from test_step_state import _cpu_kernel_path

    if float8 == "tensorwise":
        _e4m3_path_on_the_cpu(monkeypatch)
    elif float8 == "rowwise":
        _cpu_kernel_path(monkeypatch, "rowwise", keep=False)
    else:
        _cslt_stand_in(monkeypatch)
        monkeypatch.setattr(ffn, "kernels_available", lambda x: True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: on a GPU machine the granted sm90 kernels would "
                    "launch on CPU tensors (the GPU test below covers the op there)")
@pytest.mark.parametrize("float8, step", [("none", False), ("rowwise", False), ("tensorwise", False),
                                          ("tensorwise", True)])
def test_the_checkpointed_backward_recomputes_the_forward_without_ys_gemm(monkeypatch, float8, step):
    """Compiled (AOT autograd, Inductor's partitioner, the graphs run as they are): the forward graph
    calls both forward ops; the backward recomputes ffn_forward but not ffn_output under
    checkpointing, and neither without; the block's output and gradients are the same bits either
    way. Also with a step's kept weight conversions (W2^T's e4m3 one an input of ffn_output)."""
    _kernel_path(monkeypatch, float8)
    g = torch.Generator().manual_seed(4)
    T, d, F_ = 128, 64, 128
    w1, w2 = torch.randn(F_, d, generator=g) * d ** -0.5, torch.randn(d, F_, generator=g) * F_ ** -0.5
    x, dy = torch.randn(T, d, generator=g).bfloat16(), torch.randn(T, d, generator=g).bfloat16()
    m = _module(w1, w2, float8)
    plain_ops, plain = _compiled_run(m, x, dy, checkpointing=False, step=step)
    ckpt_ops, ckpt = _compiled_run(m, x, dy, checkpointing=True, step=step)
    for ops in (plain_ops, ckpt_ops):
        assert ops["forward"] == ["ffn_forward", "ffn_output"], ops
    assert plain_ops["backward"] == ["ffn_backward"], plain_ops
    assert ckpt_ops["backward"] == ["ffn_forward", "ffn_backward"], ckpt_ops
    for what, a, b in zip(("Y", "dX", "dW1", "dW2"), ckpt, plain):
        assert torch.equal(a, b), what


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductors_checkpointed_block_recomputes_without_ys_gemm_and_has_the_same_gradients_on_the_gpu():
    """The model's srelu24 FFN in a block compiled by Inductor, as the trainer runs it (float8
    tensorwise where the GPU has it: e4m3 2:4 GEMMs, Y and dX left scaled, kept weight conversions,
    two micro-batches with their gradients paired and added into .grad): with full checkpointing
    each backward calls srelu24::ffn_forward once more and srelu24::ffn_output never (the profiler's
    count of the ops' calls), and the outputs and gradients are those without checkpointing, bit for
    bit wherever the eager run repeats itself bit for bit (else within twice its own spread)."""
    from torch.profiler import ProfilerActivity, profile

    from model.ffn import kernels_available, srelu24_step
    from training.distributed import checkpointed

    if not kernels_available(torch.empty(1, device="cuda")):
        pytest.skip("needs an sm80/sm90 GPU with torch._cslt_sparse_mm")
    float8 = "tensorwise" if torch.cuda.get_device_capability() >= (8, 9) else "none"
    torch.manual_seed(5)
    T, d, F_ = 1024, 256, 1024
    w1, w2 = torch.randn(F_, d, device="cuda") * d ** -0.5, torch.randn(d, F_, device="cuda") * F_ ** -0.5
    batches = [(torch.randn(T, d, device="cuda").bfloat16(), torch.randn(T, d, device="cuda").bfloat16())
               for _ in range(2)]

    def run(checkpointing: bool, compiled: bool) -> tuple[list, dict]:
        """([each micro-batch's output and dX, then .grad of W1 and W2], {op: its calls in the backwards}),
        of the second of two steps: the first compiles (Inductor's lazily compiled backward calls the
        ops on fake tensors, which the profiler would count too)."""
        torch._dynamo.reset()
        m = _module(w1, w2, float8, "cuda")
        block = _Block(m)
        if checkpointing:
            block.forward = functools.partial(checkpointed, block.forward)
        fwd = torch.compile(block) if compiled else block
        for step in range(2):
            out, calls = [], {}
            m.zero_grad(set_to_none=True)
            with srelu24_step(m, keep_conversions=True, grads_in_place=True) as micro_batches:
                for x, dy in batches:
                    x = x.clone().requires_grad_()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = fwd(x)
                    if step == 0:
                        y.backward(dy)
                    else:
                        with profile(activities=[ProfilerActivity.CPU]) as prof:
                            y.backward(dy)
                        for e in prof.key_averages():
                            if e.key.startswith("srelu24::"):
                                calls[e.key] = calls.get(e.key, 0) + e.count
                        out += [y.detach(), x.grad]
                    micro_batches.advance()
        return out + [m.w1.weight.grad, m.w2.weight.grad], calls

    (a, _), (b, _) = run(False, False), run(False, False)
    plain, plain_calls = run(False, True)
    ckpt, ckpt_calls = run(True, True)
    if all(torch.equal(u, v) for u, v in zip(a, b)):
        for i, (u, v) in enumerate(zip(ckpt, plain)):
            assert torch.equal(u, v), i
    else:
        for i, (u, v, e1, e2) in enumerate(zip(ckpt, plain, a, b)):
            assert (u.float() - v.float()).norm() <= 2 * (e1.float() - e2.float()).norm() + 1e-12, i
    n = len(batches)
    assert plain_calls == {"srelu24::ffn_backward": n}, plain_calls
    assert ckpt_calls == {"srelu24::ffn_forward": n, "srelu24::ffn_backward": n}, ckpt_calls
