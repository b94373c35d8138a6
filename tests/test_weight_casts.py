"""kernels/weight_casts.py: srelu24's e4m3 weight conversions kept across the micro-batches of one
optimizer step. The scope's rules on the CPU (what is kept, what converts again), the op's dense
float8 GEMMs through it (CPU _scaled_mm), the memory estimate's part, and on a GPU the e4m3 op and
AdamW steps with and without it, bit for bit."""
from dataclasses import replace

import pytest
import torch

from kernels import fp8_gemm, fp8_sparse, weight_casts
from kernels.weight_casts import converted, reuse_within_step


class Counter:
    def __init__(self, fn=lambda: object()):
        self.calls, self.fn = 0, fn

    def __call__(self):
        self.calls += 1
        return self.fn()


def test_outside_the_scope_every_call_converts():
    w, c = torch.randn(8, 4), Counter()
    assert not weight_casts.active()
    a, b = converted("k", w, c), converted("k", w, c)
    assert c.calls == 2 and a is not b


def test_inside_the_scope_an_unchanged_fp32_weight_converts_once():
    w, c = torch.randn(8, 4), Counter()
    with reuse_within_step():
        assert weight_casts.active()
        first = converted("k", w, c)
        assert converted("k", w, c) is first and converted("k", w.detach(), c) is first  # an alias: the same tensor
        assert c.calls == 1
        converted("other kind", w, c)  # one weight, several conversions
        converted("k", w.t(), c)  # another view: other strides
        assert c.calls == 3
    assert not weight_casts.active()
    converted("k", w, c)
    assert c.calls == 4  # nothing outlives the scope


@pytest.mark.parametrize("write", ["add_", "copy_", "optimizer"])
def test_an_in_place_write_makes_the_weight_convert_again(write):
    w = torch.nn.Parameter(torch.randn(8, 4))
    c = Counter(lambda: w.detach().clone())
    with reuse_within_step():
        converted("k", w, c)
        with torch.no_grad():
            if write == "add_":
                w.add_(1.0)
            elif write == "copy_":  # a checkpoint load
                w.copy_(torch.zeros(8, 4))
            else:
                w.grad = torch.ones_like(w)
                torch.optim.AdamW([w], lr=0.1).step()
        assert torch.equal(converted("k", w, c), w.detach()) and c.calls == 2


def test_another_storage_at_the_same_version_converts_again():
    """A `.data =` swap (a new storage, version 0 again), and another tensor of the same shape and
    version: the entry is keyed by the storage itself, which it keeps alive."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    c = Counter()
    with reuse_within_step():
        converted("k", w, c)
        w.data = torch.randn(8, 4)
        converted("k", w, c)
        converted("k", torch.randn(8, 4), c)
        assert c.calls == 3


def test_the_step_keeps_conversions_only_with_several_micro_batches(monkeypatch):
    import training.step as step
    from test_step import batches, parts_for, tiny

    seen, real = [], step.reuse_within_step

    def recording(enabled=True):
        seen.append(enabled)
        return real(enabled)

    monkeypatch.setattr(step, "reuse_within_step", recording)
    for accum in (1, 2):
        step.train_step(parts_for(tiny(), accum=accum), step.TrainState(), iter(batches(accum, 4)).__next__)
    assert seen == [False, True]


def test_non_fp32_weights_and_a_disabled_scope_are_not_kept():
    c = Counter()
    with reuse_within_step():
        w = torch.randn(8, 4, dtype=torch.bfloat16)  # FSDP2's all-gathered weights: bf16, gathered per use
        converted("k", w, c), converted("k", w, c)
    with reuse_within_step(enabled=False):
        w = torch.randn(8, 4)
        converted("k", w, c), converted("k", w, c)
        assert not weight_casts.active()
    assert c.calls == 4


def test_scopes_nest_and_restore():
    w, c = torch.randn(8, 4), Counter()
    with reuse_within_step():
        converted("k", w, c)
        with reuse_within_step(enabled=False):
            converted("k", w, c)
        converted("k", w, c)
    assert c.calls == 2


def _micro_batches(x_seed: int, n: int, T: int, d: int, dev: str):
    g = torch.Generator(device="cpu").manual_seed(x_seed)
    return [(torch.randn(T, d, generator=g).bfloat16().to(dev), torch.randn(T, d, generator=g).bfloat16().to(dev))
            for _ in range(n)]


def _accumulated_steps(w1, w2, batches, steps: int, float8: str, reuse: bool) -> list:
    """`steps` AdamW steps of the kernel FFN, each over all `batches` (x, dy) as micro-batches, the
    conversions kept across them when `reuse`: the weights and the last step's outputs."""
    from kernels.srelu24_ffn import srelu24_ffn_kernels
    from kernels.srelu24_reference import SReLU24Recipe

    w1, w2 = (torch.nn.Parameter(w.detach().clone()) for w in (w1, w2))
    opt = torch.optim.AdamW([w1, w2], lr=1e-2)
    recipe = SReLU24Recipe(token_permutation=False)
    for _ in range(steps):
        ys = []
        with reuse_within_step(enabled=reuse):
            for x, dy in batches:
                y = srelu24_ffn_kernels(x, w1, w2, recipe, float8=float8)
                y.backward(dy)
                ys.append(y.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [w1.detach(), w2.detach(), *ys]


@pytest.mark.parametrize("float8", ["rowwise", "tensorwise"])
def test_the_ops_dense_float8_weights_convert_once_per_step_on_the_cpu(monkeypatch, float8):
    """On the CPU the 2:4 GEMMs are bf16 fallbacks (cuSPARSELt stood in for), so the kept
    conversions are the dense GEMMs' (W1^T for Z, W2 for dA): 2 per optimizer step, not 2 per
    micro-batch, and the same weights and outputs as converting each time (2 steps of 2)."""
    from helpers import cpu_scaled_mm_runs
    from test_kernels import _cslt_stand_in

    if not cpu_scaled_mm_runs(float8):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run {float8} (torch 2.13 does)")
    _cslt_stand_in(monkeypatch)
    calls, real = [], fp8_gemm.b_operand
    monkeypatch.setattr(fp8_gemm, "b_operand", lambda b, r: calls.append(tuple(b.shape)) or real(b, r))
    torch.manual_seed(3)
    T, d, F_ = 100, 64, 128
    w1, w2 = torch.randn(F_, d) * d ** -0.5, torch.randn(d, F_) * F_ ** -0.5
    batches = _micro_batches(4, 2, T, d, "cpu")
    fresh = _accumulated_steps(w1, w2, batches, 2, float8, reuse=False)
    assert len(calls) == 2 * 2 * 2
    calls.clear()
    kept = _accumulated_steps(w1, w2, batches, 2, float8, reuse=True)
    assert calls == [(d, F_), (d, F_)] * 2  # per step: W1^T [d, F] (forward), W2 [d, F] (backward)
    for got, want in zip(kept, fresh):
        assert torch.equal(got, want)


def _module_steps(w1, w2, batches, steps: int, float8: str, reuse: bool, compiled: bool,
                  grads_in_place: bool = False) -> list:
    """_accumulated_steps through the model's SReLU24 module in its 2:4 phase, under bf16 autocast
    and optionally torch.compile, as the trainer runs it; grads_in_place as build_model sets it."""
    from kernels.grads_in_place import register
    from kernels.srelu24_reference import SReLU24Recipe
    from model.ffn import SReLU24

    m = SReLU24(w1.shape[1], w1.shape[0], SReLU24Recipe(token_permutation=False)).cuda()
    m.w1.weight.data, m.w2.weight.data = w1.clone(), w2.clone()
    m.set_2to4(True)
    m.float8 = float8
    m.grads_in_place = grads_in_place
    register(m.parameters())
    fwd = torch.compile(m) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(steps):
        ys = []
        with reuse_within_step(enabled=reuse):
            for x, dy in batches:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fwd(x)
                y.backward(dy)
                ys.append(y.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [m.w1.weight.detach().clone(), m.w2.weight.detach().clone(), *ys]


@pytest.mark.gpu
@pytest.mark.parametrize("float8, compiled", [("rowwise", True), ("tensorwise", False), ("rowwise", False)])
def test_kept_conversions_give_the_same_steps_on_cuda(monkeypatch, float8, compiled):
    """The e4m3 op on sm90 (all six GEMMs in float8), in the model's module, compiled as the trainer
    compiles it: 4 weight conversions per optimizer step with the scope (W1 rows, W2 rows, W2
    columns, W1 columns), 4 per micro-batch without, and AdamW steps over three micro-batches bit
    for bit the same."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU (cuSPARSELt e4m3)")
    calls = []
    real_dense, real_sparse = fp8_gemm.b_operand, fp8_sparse.kmajor_e4m3
    monkeypatch.setattr(fp8_gemm, "b_operand", lambda b, r: calls.append(b.dtype) or real_dense(b, r))
    monkeypatch.setattr(fp8_sparse, "kmajor_e4m3", lambda b: calls.append(b.dtype) or real_sparse(b))
    torch.manual_seed(5)
    T, d, F_ = 512, 256, 1024
    w1, w2 = torch.randn(F_, d, device="cuda") * d ** -0.5, torch.randn(d, F_, device="cuda") * F_ ** -0.5
    batches = _micro_batches(6, 3, T, d, "cuda")
    fresh = _module_steps(w1, w2, batches, 2, float8, False, compiled)
    assert calls.count(torch.float32) == 4 * 3 * 2  # x and dY's conversions are bf16
    calls.clear()
    kept = _module_steps(w1, w2, batches, 2, float8, True, compiled)
    assert calls.count(torch.float32) == 4 * 2
    for got, want in zip(kept, fresh):
        assert torch.equal(got, want)


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
    assert e.peak == estimate(m, f, 32000, replace(accum, float8=Float8.none)).peak + e.parts[KEPT_CONVERSIONS]
    for other in (replace(accum, batch_size=2), replace(accum, float8=Float8.none),
                  replace(accum, strategy=Strategy.fsdp)):
        assert KEPT_CONVERSIONS not in estimate(m, f, 32000, other).parts
    assert KEPT_CONVERSIONS not in estimate(m, replace(f, sparse_float8=False), 32000, accum).parts
    assert KEPT_CONVERSIONS not in estimate(m, FFNConfig(kind="srelu"), 32000, accum).parts
