"""trainer.float8 (training/float8.py, srelu24_kernels/float8/gemm.py): which linears torchao converts and in
which order build_model applies it, the FSDP2 float8 all-gather, the srelu24 op's dense float8
GEMMs against torchao's casts and their fp32 reference, the configs, and the error where float8
cannot run. torch's CPU _scaled_mm (torch >= 2.13) runs the float8 GEMMs here; the GPU tests run
them on tensor cores, compiled, against bf16."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import triton

import srelu24_kernels.float8.gemm as fp8
from helpers import (BASE_ENV, EXPERIMENTS, ROOT, background, compose_config, forward_args, kernel_ffn, output_args,
                     run_train, tiny_overrides, to_object, with_cache)
from model import FFNConfig, ModelConfig, Transformer
from training import float8
from training.config import Float8, OptimConfig, Strategy, TrainerConfig
from training.distributed import Dist, build_model
from training.errors import ConfigError

RECIPES = [Float8.tensorwise, Float8.rowwise]
TINY = ModelConfig(name="t", dim=64, n_layers=2, n_heads=2, swiglu_hidden=128, max_seq_len=64)


@background
def launches(ctx):
    """The launches of the module's command-line and multi-process tests (helpers.background), run
    while the in-process tests run; each test waits for its own."""
    tmp, corpus, cache = ctx.tmp("cpu_float8"), ctx.corpus, ctx.cache
    jobs = {"test_fsdp_float8_all_gather_on_two_processes": lambda: run_fsdp_model(2),  # CPU, gloo
            "test_train_on_the_cpu_with_float8_exits_2_with_one_line":
                lambda: check_train_on_the_cpu_with_float8_exits_2_with_one_line(tmp, corpus, cache),
            "test_none_converts_nothing_and_imports_no_torchao": check_none_converts_nothing_and_imports_no_torchao,
            "test_float8_is_off_by_default_and_a_bad_value_lists_the_valid_ones":
                lambda: run_train(["trainer.float8=e4m3", "trainer.dry_run=true"])}
    return jobs


def meta_model(kind: str, cfg: ModelConfig = TINY, vocab: int = 96, float8: str = "none") -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg, FFNConfig(kind=kind), vocab, float8=float8)


def linear_types(model: nn.Module) -> dict:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def adamw_losses(model: nn.Module, opt, batches: list, steps: int) -> list[float]:
    """`steps` AdamW steps (bf16 autocast) over `batches` in turn, float8's scales refreshed after
    each as the trainer's step does: the loss of each step."""
    losses = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float8.float8_after_optimizer_step(model)
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- which linears convert

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["swiglu", "srelu", "srelu24"])
def test_every_block_linear_converts_and_the_output_head_stays_bf16(kind, recipe):
    model = meta_model(kind, float8=recipe.value)
    float8.convert(model, recipe, fsdp=False)
    types = linear_types(model)
    ffn = ["w1", "w3", "w2"] if kind == "swiglu" else ["w1", "w2"]
    want = {f"layers.{i}.{m}": "Float8Linear" for i in range(TINY.n_layers)
            for m in [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")] + [f"feed_forward.{w}" for w in ffn]}
    assert types == {**want, "output": "Linear"}
    config = model.layers[0].attention.wq.config
    assert config.cast_config_input.scaling_granularity.value == {"tensorwise": "tensorwise",
                                                                  "rowwise": "axiswise"}[recipe.value]
    # srelu24's own op follows the recipe in its 2:4 phase
    assert [getattr(b.feed_forward, "float8", None) for b in model.layers] == (
        [recipe.value] * TINY.n_layers if kind == "srelu24" else [None] * TINY.n_layers)


@pytest.mark.parametrize("recipe", RECIPES)
def test_rowwise_sets_inductors_cast_settings_and_tensorwise_leaves_them(recipe):
    """rowwise: eager's rounding in compiled casts and N-D tiling for their transposed copies
    (lab/LOG.md); tensorwise gained nothing from the tiling and keeps the defaults."""
    import torch._inductor.config as ic

    with ic.patch({"emulate_precision_casts": False, "triton.prefer_nd_tiling": False}):
        float8.convert(meta_model("swiglu"), recipe, fsdp=False)
        rowwise = recipe == Float8.rowwise
        assert (ic.emulate_precision_casts, ic.triton.prefer_nd_tiling) == (rowwise, rowwise)


def test_linears_with_a_dim_not_divisible_by_16_stay_bf16():
    """dim 40: attention (40 x 40) and the FFN's inputs/outputs (40 x 128) do not convert; srelu24
    then keeps its op's dense GEMMs in bf16 too."""
    cfg = ModelConfig(name="t", dim=40, n_layers=1, n_heads=2, swiglu_hidden=128, max_seq_len=64)
    for kind in ("swiglu", "srelu24"):
        model = meta_model(kind, cfg, float8="rowwise")
        float8.convert(model, Float8.rowwise, fsdp=False)
        assert set(linear_types(model).values()) == {"Linear"}
        assert kind != "srelu24" or model.layers[0].feed_forward.float8 == "none"
    # and the filter on its own: both dims count
    assert float8.converts(nn.Linear(32, 48), "layers.0.attention.wq")
    assert not float8.converts(nn.Linear(32, 40), "layers.0.attention.wq")
    assert not float8.converts(nn.Linear(40, 32), "layers.0.attention.wq")
    assert not float8.converts(nn.Linear(32, 48), "output")


def test_none_converts_nothing_and_imports_no_torchao(launched):
    launched["test_none_converts_nothing_and_imports_no_torchao"].result()


def check_none_converts_nothing_and_imports_no_torchao():
    code = ("import sys, torch; from training import float8; from training.config import Float8; "
            "from model import FFNConfig, ModelConfig, Transformer; "
            "m = Transformer(ModelConfig(dim=64, n_layers=1, n_heads=2), FFNConfig(kind='srelu24'), 96); "
            "float8.convert(m, Float8.none, fsdp=True); float8.float8_after_optimizer_step(m); "
            "assert all(type(x) is torch.nn.Linear for x in m.modules() if isinstance(x, torch.nn.Linear)); "
            "assert m.layers[0].feed_forward.float8 == 'none'; assert 'torchao' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("recipe,gathers", [(Float8.tensorwise, True), (Float8.rowwise, False)])
def test_fsdp_all_gathers_float8_weights_where_the_recipe_can(recipe, gathers):
    """tensorwise under FSDP2: the converted weights become torchao's float8-all-gather tensors,
    except srelu24's (its custom op takes plain weights); rowwise all-gathers bf16."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for kind in ("swiglu", "srelu24"):
        model = meta_model(kind, float8=recipe.value)
        float8.convert(model, recipe, fsdp=True)
        wrapped = {n for n, p in model.named_parameters() if isinstance(p, WeightWithDynamicFloat8CastTensor)}
        want = {f"layers.{i}.attention.{w}.weight" for i in range(TINY.n_layers) for w in ("wq", "wk", "wv", "wo")}
        if kind == "swiglu":
            want |= {f"layers.{i}.feed_forward.{w}.weight" for i in range(TINY.n_layers) for w in ("w1", "w2", "w3")}
        assert wrapped == (want if gathers else set())
        assert model.float8_scales_after_step is gathers
    model = meta_model("swiglu")
    float8.convert(model, Float8.tensorwise, fsdp=False)  # no FSDP: nothing to precompute
    assert not model.float8_scales_after_step and not any(
        isinstance(p, WeightWithDynamicFloat8CastTensor) for p in model.parameters())


# ---------------------------------------------------------------- build_model's order

def test_build_model_converts_first_then_checkpoints_compiles_and_shards(monkeypatch):
    """The documented order: float8, activation checkpointing, compile, sharding, materialise."""
    import training.distributed as D
    from model.transformer import Block

    calls = []

    def record(name, fn):
        def wrapper(*a, **kw):
            calls.append(name)
            return fn(*a, **kw) if fn else None
        return wrapper

    monkeypatch.setattr(float8, "check", record("check", None))
    monkeypatch.setattr(float8, "convert", record("float8", float8.convert))
    monkeypatch.setattr(D, "apply_activation_checkpointing", record("checkpointing", D.apply_activation_checkpointing))
    monkeypatch.setattr(Block, "compile", record("compile", None), raising=False)
    monkeypatch.setattr(torch, "compile", record("compile loss", lambda f, **kw: f))
    monkeypatch.setattr(D, "shard", record("shard", None))
    monkeypatch.setattr(Transformer, "reset_parameters", record("init", Transformer.reset_parameters))
    t = TrainerConfig(float8=Float8.rowwise, activation_checkpointing="full", compile=True, strategy=Strategy.fsdp,
                      device="cpu")
    model, _ = build_model(lambda: Transformer(TINY, FFNConfig(), 96), t, Dist(), seed=0, bf16_params=False)
    # the first init is the constructor's, on the meta device; the last one materialises
    assert calls == ["check", "init", "float8", "checkpointing", "compile", "compile", "compile loss", "shard", "init"]
    assert linear_types(model)["layers.0.attention.wq"] == "Float8Linear"
    assert model.layers[0].attention.wq.weight.device.type == "cpu"


def test_build_model_with_float8_none_is_unchanged():
    model, _ = build_model(lambda: Transformer(TINY, FFNConfig(), 96), TrainerConfig(device="cpu"), Dist(), seed=0,
                           bf16_params=False)
    assert set(linear_types(model).values()) == {"Linear"}


@pytest.mark.parametrize("kind", ["swiglu", "srelu24"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_training_follows_bf16_on_cpu(monkeypatch, kind, recipe):
    """A few AdamW steps of the converted model (bf16 autocast, CPU _scaled_mm) against the same
    model unconverted, same data: close, not equal (float8 is in effect). srelu24 in its dense
    warmup here; its 2:4 op is tested below."""
    from training.optim import build_optimizer

    monkeypatch.setattr(float8, "check", lambda *a: None)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 96, (4, 33), generator=g)
    losses = {}
    for r in (Float8.none, recipe):
        t = TrainerConfig(float8=r, device="cpu")
        model, _ = build_model(lambda: Transformer(TINY, FFNConfig(kind=kind), 96, float8=r.value), t, Dist(), 0, False)
        opt = build_optimizer(model, OptimConfig(lr=3e-3, warmup_steps=0), torch.device("cpu"))
        losses[r] = adamw_losses(model, opt, [batch], 6)
    ref, got = losses[Float8.none], losses[recipe]
    assert ref[-1] < ref[0] - 0.05 and got[-1] < got[0] - 0.05  # both learn
    assert got != ref and all(abs(a - b) / b < 0.02 for a, b in zip(got, ref)), (got, ref)


def run_fsdp_model(nproc: int, *args: str) -> None:
    """tests/float8_fsdp_model.py under torchrun: FSDP2 with tensorwise float8 all-gather and the
    scales precomputed after each step, against the unsharded model."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "tests" / "float8_fsdp_model.py"), *args]
    env = {**BASE_ENV, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for rank in range(nproc):
        assert f"rank {rank}: 3 steps equal to the unsharded model, scales of the whole weights" in out, out[-3000:]


@pytest.mark.slow
def test_fsdp_float8_all_gather_on_two_processes(launched):
    launched["test_fsdp_float8_all_gather_on_two_processes"].result()  # run_fsdp_model(2): CPU, gloo


@pytest.mark.gpu
def test_fsdp_float8_all_gather_compiled_on_one_gpu():
    run_fsdp_model(1, "cuda")  # NCCL, compiled blocks


# ---------------------------------------------------------------- srelu24's float8 GEMMs

@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_recipes_are_torchaos(recipe):
    """Gradient dtype, scale granularity and rounding, and fast accumulation as torchao's recipe."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from torchao.float8 import Float8LinearConfig, ScalingGranularity

    c, r = Float8LinearConfig.from_recipe_name(recipe), fp8.RECIPES[recipe]
    axiswise = ScalingGranularity.AXISWISE
    assert r.rowwise == (c.cast_config_input.scaling_granularity is axiswise)
    assert r.rowwise == (c.cast_config_grad_output.scaling_granularity is axiswise)
    assert r.rowwise == (c.cast_config_weight_for_grad_input.scaling_granularity is axiswise)
    assert c.cast_config_input.target_dtype == c.cast_config_weight.target_dtype == fp8.E4M3
    assert c.cast_config_weight_for_grad_input.target_dtype == fp8.E4M3
    assert r.grad_dtype == c.cast_config_grad_output.target_dtype
    assert r.pow2_scales == c.round_scales_to_power_of_2
    # mm: fast accumulation for the forward GEMM only
    assert c.gemm_config_output.use_fast_accum and not c.gemm_config_grad_input.use_fast_accum


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("grad", [False, True])
def test_fp8_casts_equal_torchaos_bit_for_bit(recipe, grad):
    """The operands of Z = X W1^T (grad=False) and dA = dY W2 (grad=True) as torchao's Float8Linear
    casts them: the same float8 bits and scales."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from torchao.float8 import Float8LinearConfig, LinearMMConfig
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic

    c, r = Float8LinearConfig.from_recipe_name(recipe), fp8.RECIPES[recipe]
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(96, 64, generator=g) * torch.logspace(-3, 2, 96).unsqueeze(1)).bfloat16()
    a[5] = 0  # an all-zero row: the floor on amax
    w = (torch.randn(64, 128, generator=g) / 8).bfloat16()  # b = W1^T [d, F] or W2 [d, F]: K = d is dim 0
    # torchao: the input / grad_output along its last dim; the weight as weight.t() [K, N] along dim 0
    # for the forward, as weight [N, K] along its last dim for grad input
    a_cast = c.cast_config_grad_output if grad else c.cast_config_input
    w_cast = c.cast_config_weight_for_grad_input if grad else c.cast_config_weight
    want_a = hp_tensor_to_float8_dynamic(a, a_cast.target_dtype, LinearMMConfig(),
                                         scaling_granularity=a_cast.scaling_granularity,
                                         axiswise_dim=get_maybe_axiswise_dim(-1, a_cast.scaling_granularity),
                                         round_scales_to_power_of_2=c.round_scales_to_power_of_2)
    hp_w, dim = (w.t(), -1) if grad else (w, 0)
    want_w = hp_tensor_to_float8_dynamic(hp_w, w_cast.target_dtype, LinearMMConfig(),
                                         scaling_granularity=w_cast.scaling_granularity,
                                         axiswise_dim=get_maybe_axiswise_dim(dim, w_cast.scaling_granularity),
                                         round_scales_to_power_of_2=c.round_scales_to_power_of_2)
    got_a, sa, _ = fp8.to_float8(a, r.grad_dtype if grad else fp8.E4M3, 1 if r.rowwise else None, r.pow2_scales)
    got_w, sw, _ = fp8.to_float8(w, fp8.E4M3, 0 if r.rowwise else None, r.pow2_scales)
    want_w_data, want_w_scale = (want_w._data.t(), want_w._scale.t()) if grad else (want_w._data, want_w._scale)
    assert got_a.dtype == want_a._data.dtype and got_w.dtype == want_w_data.dtype
    assert torch.equal(got_a.view(torch.uint8), want_a._data.view(torch.uint8))
    assert torch.equal(got_w.view(torch.uint8), want_w_data.view(torch.uint8))
    assert torch.equal(sa, want_a._scale.reshape(sa.shape)) and torch.equal(sw, want_w_scale.reshape(sw.shape))


@pytest.mark.parametrize("fmax,pow2", [(448.0, False), (57344.0, False), (448.0, True)])
def test_amax_to_scale_kernel_equals_torchaos_formula_for_every_bf16_amax(fmax, pow2):
    """The one-launch scale kernel (Triton interpreter) against the PyTorch formula, for every
    non-negative bf16 amax (all 2^15 bit patterns, zero, subnormals, inf and NaN among them), in a
    random order: scale and reciprocal bit for bit."""
    bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16)
    amax = bits[torch.randperm(bits.numel())].view(torch.bfloat16)
    want_s, want_i = fp8.amax_to_scale_reference(amax, fmax, pow2)
    got_s, got_i = torch.empty_like(want_s), torch.empty_like(want_i)
    n = amax.numel()
    fp8._amax_to_scale_kernel[(triton.cdiv(n, 1024),)](amax, got_s, got_i, n, FMAX=fmax, POW2=pow2, BLOCK=1024)
    for got, want in ((got_s, want_s), (got_i, want_i)):
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), amax[~same][:4]


def test_amax_to_scale_kernel_pow2_is_not_torchaos_for_fp32_amaxes():
    """Why an fp32 amax takes amax_to_scale's reference: just above 1.75 2^e, 448 / amax rounds to
    within an ulp below a power of 2, torchao's float32 log2 rounds that up to the integer, and its
    scale is twice the kernel's (which keeps the exponent: the largest power of 2 that fits)."""
    base = torch.tensor([1.75 * 2.0 ** e for e in range(-12, 9)])
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU's own kernel where there is one
    amax = torch.cat([(base.view(torch.int32) + j).view(torch.float32) for j in range(16)]).to(dev)
    want_s, _ = fp8.amax_to_scale_reference(amax, 448.0, True)
    got_s, got_i = torch.empty_like(want_s), torch.empty_like(want_s)
    fp8._amax_to_scale_kernel[(1,)](amax, got_s, got_i, amax.numel(), FMAX=448.0, POW2=True, BLOCK=1024)
    differ = got_s != want_s
    assert differ.any() and torch.equal(want_s[differ], 2 * got_s[differ])
    assert (amax * got_s <= 448).all() and (amax[differ] * want_s[differ] > 448).all()
    assert torch.equal(fp8.amax_to_scale(amax, 448.0, True)[0], want_s)  # the public function: torchao's


@pytest.mark.parametrize("k", [48, 64])
def test_rowwise_kernel_equals_the_pytorch_path_for_every_bf16_amax(k):
    """The one-launch rowwise cast (fp8_gemm.rowwise_e4m3; here the Triton interpreter) against
    to_float8's PyTorch path: one row per non-negative bf16 amax (all 2^15 bit patterns: zero,
    subnormals, inf and NaN among them), the amax at a random place among smaller values. Bytes,
    scales and reciprocals bit for bit; NaN where PyTorch has NaN."""
    g = torch.Generator().manual_seed(k)
    amax = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    t = (torch.rand(amax.numel(), k, generator=g) * 2 - 1) * torch.nan_to_num(amax, nan=1.0, posinf=1.0)[:, None]
    t[torch.arange(amax.numel()), torch.randint(0, k, (amax.numel(),), generator=g)] = amax
    t = t.bfloat16()
    want = fp8.to_float8(t, fp8.E4M3, 1, True)
    got = fp8.rowwise_e4m3(t)
    assert got[1].shape == got[2].shape == (amax.numel(), 1)
    for name, g_, w in zip(("cast", "scale", "1 / scale"), got, want):
        nan = w.float().isnan()
        bits = (lambda x: x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int32))
        assert torch.equal(g_.float().isnan(), nan), name
        assert torch.equal(bits(g_)[~nan], bits(w)[~nan]), name


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("grad", [False, True])
def test_fp8_mm_equals_its_reference_on_cpu(recipe, grad):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(100, 64, generator=g).bfloat16()
    w = (torch.randn(128, 64, generator=g) / 8).bfloat16()
    b = w.t() if not grad else w.t().contiguous()  # W1^T (a column-major view) or W2 (row-major)
    got, want = fp8.mm(a, b, recipe, grad), fp8.mm_reference(a, b, recipe, grad)
    assert got.dtype == torch.bfloat16 and got.shape == (100, 128)
    assert rel(got, want) < 3e-3  # bf16 rounding of the output
    assert rel(want, a.float() @ b.float()) > 1e-2  # and the reference is float8's, not the exact product


def _cslt_stand_in(monkeypatch):
    from test_kernels import _cslt_stand_in as stand_in

    stand_in(monkeypatch)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_srelu24_op_runs_exactly_its_two_dense_gemms_in_float8(monkeypatch, recipe):
    """The kernel FFN (CPU: Triton interpreter, cuSPARSELt stood in for) calls fp8_gemm for
    Z = X W1^T (forward) and dA = dY W2 (backward, as a gradient) and nothing else; its output and
    gradients stay near the bf16 op's."""
    import srelu24_kernels.srelu24.op as K
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    _cslt_stand_in(monkeypatch)
    calls, real = [], fp8.mm

    def recording(a, b, r, grad=False, b_float8=None, a_float8=None):
        calls.append((tuple(a.shape), tuple(b.shape), r, grad))
        return real(a, b, r, grad, b_float8, a_float8)

    monkeypatch.setattr(fp8, "mm", recording)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(100, 64, generator=g).bfloat16()
    w1, w2 = torch.randn(128, 64, generator=g) / 8, torch.randn(64, 128, generator=g) / 11
    dy = torch.randn(100, 64, generator=g).bfloat16()
    outs = {}
    for setting in ("none", recipe):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = kernel_ffn(xx, a, b, SReLU24Recipe(False, 0.05, True), None, setting)
        y.backward(dy)
        outs[setting] = [y, xx.grad, a.grad, b.grad]
    assert calls == [((100, 64), (64, 128), recipe, False), ((100, 64), (64, 128), recipe, True)]
    # float8's rounding (e5m2 gradients: 2 mantissa bits) and the 2:4 choices it flips: 5-12% here
    for got, want in zip(outs[recipe], outs["none"]):
        assert 0 < rel(got, want) < 0.2


def test_srelu24_op_with_float8_passes_opcheck_and_compiles_in_one_graph(monkeypatch):
    import srelu24_kernels.srelu24.op as K
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    _cslt_stand_in(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, 64, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(128, 64, generator=g) / 8).bfloat16().requires_grad_()
    w2 = (torch.randn(64, 128, generator=g) / 11).bfloat16().requires_grad_()
    o = K.OpOptions(SReLU24Recipe(False, 0.05, True), "rowwise")
    torch.library.opcheck(K.ffn_forward, forward_args(x, w1, w2, False, o))
    torch.library.opcheck(K.ffn_output, output_args(K.ffn_forward(*forward_args(x, w1, w2, False, o)), w2, o))

    def ffn(xx, a, b):
        return kernel_ffn(xx, a, b, SReLU24Recipe(False, 0.05, True), None, "tensorwise")

    torch._dynamo.reset()
    want = ffn(x, w1, w2)
    got = torch.compile(ffn, backend="aot_eager", fullgraph=True)(x, w1, w2)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- configs and errors

@pytest.mark.parametrize("recipe", ["none", "tensorwise", "rowwise"])
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_with_each_recipe(experiment, recipe):
    cfg = to_object(compose_config([f"+experiment={experiment}", f"trainer.float8={recipe}"]))
    assert cfg.trainer.float8 == Float8(recipe)


def test_float8_is_off_by_default_and_a_bad_value_lists_the_valid_ones(launched):
    assert to_object(compose_config([])).trainer.float8 == Float8.none
    r = launched["test_float8_is_off_by_default_and_a_bad_value_lists_the_valid_ones"].result()
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "trainer.float8" in lines[0], r.stderr
    assert "[none, tensorwise, rowwise]" in lines[0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_on_the_cpu_is_a_config_error_naming_the_setting(recipe):
    with pytest.raises(ConfigError, match=rf"^trainer.float8={recipe.value} needs a CUDA GPU .* on cpu: "
                                          r"set trainer.float8=none$"):
        float8.check(recipe, torch.device("cpu"))
    float8.check(Float8.none, torch.device("cpu"))  # off: nothing to check


def test_float8_before_sm89_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    for cap, ok in [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        if ok:
            float8.check(Float8.rowwise, torch.device("cuda", 0))
        else:
            with pytest.raises(ConfigError, match=rf"trainer.float8=rowwise .* A100-SXM4-80GB is {cap[0]}.{cap[1]}: "
                                                  r"set trainer.float8=none"):
                float8.check(Float8.rowwise, torch.device("cuda", 0))


def test_train_on_the_cpu_with_float8_exits_2_with_one_line(launched):
    launched["test_train_on_the_cpu_with_float8_exits_2_with_one_line"].result()


def check_train_on_the_cpu_with_float8_exits_2_with_one_line(tmp_path, corpus, cache):
    r = run_train(with_cache(tiny_overrides(tmp_path, corpus, ["trainer.float8=tensorwise", "trainer.device=cpu"]),
                             cache))
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: trainer.float8=tensorwise needs a CUDA GPU"), r.stderr


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("fmax,pow2", [(448.0, False), (57344.0, False), (448.0, True)])
def test_amax_to_scale_on_cuda_equals_torchaos_formula_for_every_bf16_amax(fmax, pow2):
    bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16)
    amax = bits[torch.randperm(bits.numel())].view(torch.bfloat16).cuda()
    for got, want in zip(fp8.amax_to_scale(amax, fmax, pow2), fp8.amax_to_scale_reference(amax, fmax, pow2)):
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), amax[~same][:4]
    # a float32 amax can put the scale just under a power of 2 (1.7500001: 255.99998), where the
    # kernel's exponent rounding would differ from exp2(floor(log2)): it takes the reference there
    f32 = torch.tensor([1.7500001, 3.0], device="cuda")
    assert torch.equal(fp8.amax_to_scale(f32, fmax, pow2)[0], fp8.amax_to_scale_reference(f32, fmax, pow2)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("m,k,n", [(1000, 256, 1024), (4096, 512, 2048)])
def test_fp8_mm_on_cuda_equals_its_reference(recipe, grad, m, k, n):
    """torch._scaled_mm on tensor cores against the fp32 product of the same float8 values."""
    g = torch.Generator().manual_seed(6)
    a = torch.randn(m, k, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) / 16).bfloat16().cuda()
    b = w.t() if not grad else w.t().contiguous()
    got, want = fp8.mm(a, b, recipe, grad), fp8.mm_reference(a, b, recipe, grad)
    assert got.dtype == torch.bfloat16 and rel(got, want) < 1e-2
    assert rel(want, a.float() @ b.float()) > 2e-2  # float8's error is far above the tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_column_scales_of_a_row_major_b_on_cuda(dtype):
    """dA = dY W2's B (W2 [d, F] row-major, scales per column): on a GPU srelu24_kernels.float8.cast.columns_to_e4m3, the
    cast written K-major. bf16: torchao's bytes and scales (the PyTorch path's) bit for bit. fp32:
    the largest power-of-2 scales that fit, which torchao's float32 log2 exceeds 2x for rare amaxes."""
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(512, 384, generator=g) * torch.logspace(-3, 2, 384)[None, :]).to(dtype)
    q, s, inv = fp8.to_float8(w.cuda(), fp8.E4M3, 0, True, column_major=True)
    want_q, want_s, want_inv = fp8.to_float8(w, fp8.E4M3, 0, True, column_major=True)
    assert q.shape == (512, 384) and q.t().is_contiguous() and s.shape == inv.shape == (1, 384)
    same = (s.cpu() == want_s)[0]
    assert same.all() if dtype == torch.bfloat16 else same.float().mean() > 0.95
    assert torch.equal(2 * s.cpu()[0][~same], want_s[0][~same])  # where torchao's log2 rounds up
    assert torch.equal(q.cpu()[:, same].view(torch.uint8), want_q[:, same].view(torch.uint8))
    assert torch.equal(inv.cpu(), 1 / s.cpu()) and (w.abs().amax(0) * s.cpu()[0] <= 448).all()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_srelu24_kernels_in_float8_on_cuda_follow_bf16(recipe):
    """The real 2:4 kernels and cuSPARSELt with the dense GEMMs in float8: output and gradients
    close to the bf16 op's."""
    import srelu24_kernels.srelu24.op as K
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 256, generator=g).bfloat16().cuda()
    w1, w2 = (torch.randn(1024, 256, generator=g) / 16).cuda(), (torch.randn(256, 1024, generator=g) / 32).cuda()
    dy = torch.randn(2048, 256, generator=g).bfloat16().cuda()
    outs = {}
    for setting in ("none", recipe):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = kernel_ffn(xx, a, b, SReLU24Recipe(), None, setting)
        torch.manual_seed(3)  # the same token permutation
        y.backward(dy)
        outs[setting] = [y, xx.grad, a.grad, b.grad]
    for got, want in zip(outs[recipe], outs["none"]):
        assert 0 < rel(got, want) < 0.2  # as on the CPU: float8 rounding and flipped 2:4 choices


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["swiglu", "srelu24"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_float8_training_on_cuda_follows_bf16(kind, recipe):
    """build_model as the trainer runs it (compile, bf16 autocast), 20 AdamW steps over 4 fixed
    batches: the float8 loss follows bf16's (first step within 1%; the last five on average no more
    than 2% above bf16's, nor 5% below). srelu24 in its 2:4 phase. The late bounds are lopsided:
    20 steps of memorising random tokens amplify any rounding difference, and the float8 curve
    lands on either side of bf16's by seed (srelu24 tensorwise: -2.65%, -1.02%, +1.08% for seeds
    8-10, on the H200; lab/LOG.md), while a broken float8 path trains worse.
    Wrong gradients show at the first step, where no trajectory hides them:
    test_float8_first_step_gradients_on_cuda. No graph break at a call (dynamo's graph_break
    counter): a break splits a block and loses the fusions across it (torch 2.11 broke srelu24's
    block where its call built an options object, costing 1% of the 7B step)."""
    from torch._dynamo.utils import counters

    from training.optim import build_optimizer

    cfg = ModelConfig(name="t", dim=512, n_layers=4, n_heads=8, swiglu_hidden=1536, max_seq_len=512)
    device = torch.device("cuda")
    losses = {}
    for r in (Float8.none, recipe):
        t = TrainerConfig(float8=r, compile=True, device="cuda")
        model, _ = build_model(lambda: Transformer(cfg, FFNConfig(kind=kind), 1024, float8=r.value), t,
                               Dist(device=device), 0, False)
        model.set_2to4(kind == "srelu24")
        opt = build_optimizer(model, OptimConfig(lr=1e-3, warmup_steps=0), device)
        g = torch.Generator().manual_seed(8)
        batches = [torch.randint(0, 1024, (8, 257), generator=g).to(device) for _ in range(4)]
        counters.clear()
        losses[r] = adamw_losses(model, opt, batches, 20)  # each batch seen 5 times: the loss falls fast
        assert not counters["graph_break"], (r, dict(counters["graph_break"]))
        torch._dynamo.reset()
    ref, got = losses[Float8.none], losses[recipe]
    assert ref[-1] < ref[0] - 0.4, (got, ref)  # it learns (bf16 fell 7.04 -> 6.43 on an H200)
    assert abs(got[0] - ref[0]) / ref[0] < 0.01 and got != ref, (got, ref)
    # no more than 2% above bf16's; below it by seed, and far below only if something is off
    assert 0.95 * sum(ref[-5:]) < sum(got[-5:]) < 1.02 * sum(ref[-5:]), (got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["swiglu", "srelu24"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_first_step_gradients_on_cuda(kind, recipe):
    """One step of the model in float8 (eager, bf16 autocast; srelu24 in its 2:4 phase, fp32 weights
    into its e4m3 op) against bf16: every parameter's gradient within 35% of bf16's (relative norm),
    the median within 25%. On the H200 the worst was 0.24 and the median 0.20 for srelu24
    tensorwise (2:4 choices flipped by float8's rounding); a wrong gradient is off by order 1."""
    cfg = ModelConfig(name="t", dim=512, n_layers=4, n_heads=8, swiglu_hidden=1536, max_seq_len=512)
    batch = torch.randint(0, 1024, (8, 257), generator=torch.Generator().manual_seed(8)).cuda()
    grads = {}
    for r in (Float8.none, recipe):
        model, _ = build_model(lambda: Transformer(cfg, FFNConfig(kind=kind), 1024, float8=r.value),
                               TrainerConfig(float8=r, compile=False, device="cuda"), Dist(device=torch.device("cuda")),
                               0, False)
        model.set_2to4(kind == "srelu24")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(batch[:, :-1], batch[:, 1:]).backward()
        grads[r] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    ref, got = grads[Float8.none], grads[recipe]
    assert got.keys() == ref.keys()
    dist = sorted(rel(got[n], ref[n]) for n in ref)
    assert 0 < dist[len(dist) // 2] < 0.25 and dist[-1] < 0.35, dist
