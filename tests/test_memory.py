"""training/memory.py: the peak-memory estimate against peaks measured on an H200
(torch.cuda.max_memory_allocated of compiled bf16 steps, fused AdamW), its parts, and the dry run's rows."""
from dataclasses import replace

import pytest

from helpers import background, run_train
from model import FFNConfig, ModelConfig, ffn_hidden_dim
from training.config import ActivationCheckpointing, Float8, Strategy, TrainerConfig
from training.checkpoint import checkpoint_bytes
from training.memory import WEIGHT_COPIES, GiB, _meta_model, block_activation_bytes, estimate

V = 32768  # FineWeb-Edu's tokenizer
M1B = ModelConfig(name="1b", dim=2048, n_layers=20, n_heads=16, swiglu_hidden=5632)
M7B = ModelConfig(name="7b", dim=4096, n_layers=32, n_heads=32, swiglu_hidden=11008)
BENCH_1B = TrainerConfig(seq_len=2048, batch_size=8, micro_batch_size=8)    # bench_step: no accumulation
BENCH_7B = TrainerConfig(seq_len=4096, batch_size=2, micro_batch_size=2)
TRAIN_1B = TrainerConfig(seq_len=2048, batch_size=512, micro_batch_size=8)  # configs/experiment/scale/1b.yaml
TRAIN_7B_ONE_GPU = TrainerConfig(seq_len=4096, batch_size=8, micro_batch_size=2,
                                 activation_checkpointing=ActivationCheckpointing.full)
TRAIN_7B_FSDP = TrainerConfig(seq_len=4096, batch_size=1024, micro_batch_size=2, strategy=Strategy.fsdp,
                              activation_checkpointing=ActivationCheckpointing.full)

MEASURED = [  # (model, ffn, trainer, srelu24's 2:4 phase, GiB measured)
    (replace(M1B, n_layers=16), "srelu", BENCH_1B, None, 31.00),      # benchmarks/results/memory_1b16_bf16.json
    (replace(M1B, n_layers=16), "srelu24", BENCH_1B, True, 25.09),
    (replace(M1B, n_layers=16), "swiglu", BENCH_1B, None, 30.99),     # at commit d592200: bench_step_1b_sweep_s6.json
    (replace(M7B, n_layers=8), "srelu", BENCH_7B, None, 33.91),       # memory_7b8_bf16.json
    (replace(M7B, n_layers=8), "srelu24", BENCH_7B, True, 31.68),
    (replace(M7B, n_layers=8), "swiglu", BENCH_7B, None, 33.90),      # at commit d592200: bench_step_7b_sweep_s6.json
    (M1B, "srelu24", TRAIN_1B, False, 43.6),                          # the trainer, sparse_1b: dense warmup
    (M1B, "srelu24", TRAIN_1B, True, 36.2),                           # and 2:4
    (M7B, "srelu", TRAIN_7B_FSDP, None, 106.6),                       # full 7B, FSDP + full AC, one GPU
    # full 7B, one GPU, no FSDP, full AC, 4 micro-batches a step (the README's one-GPU sparse_7b):
    # dense warmup and 2:4 (benchmarks/RESULTS.md, memory)
    (M7B, "srelu24", TRAIN_7B_ONE_GPU, False, 118.04),
    (M7B, "srelu24", TRAIN_7B_ONE_GPU, True, 109.74),
]


# Compiled float8 tensorwise runs of the trainer on one H100 (the python_sources corpus, vocabulary 8192):
# peak reserved GiB over the whole run (its metrics' mem_reserved_gib), since a CUDA graph's pool is
# reserved, not allocated, between replays. srelu24's peak is its dense warmup's at 1B, its 2:4
# phase's at 7B shapes.
GRAPHED_1B = TrainerConfig(seq_len=2048, batch_size=32, micro_batch_size=8, float8=Float8.tensorwise, compile=True,
                           cuda_graph=True)  # configs/experiment/study_speed.yaml, trainer.batch_size=32
TRAIN_7B8 = TrainerConfig(seq_len=4096, batch_size=8, micro_batch_size=2, float8=Float8.tensorwise, compile=True)
MEASURED_FLOAT8 = [  # (model, ffn, trainer, srelu24's 2:4 phase, GiB measured)
    (M1B, "srelu", GRAPHED_1B, None, 51.19),       # train_1b_200_accum4_cuda_graph_srelu_metrics_60e25d8.jsonl
    (M1B, "srelu24", GRAPHED_1B, False, 51.30),    # train_1b_200_accum4_cuda_graph_srelu24_metrics_137834d.jsonl
    (replace(M7B, n_layers=8), "srelu", TRAIN_7B8, None, 34.55),    # train_7b8_250_srelu_metrics_b57237d.jsonl
    (replace(M7B, n_layers=8), "srelu24", TRAIN_7B8, True, 36.09),  # train_7b8_250_srelu24_metrics_b57237d.jsonl
]


@pytest.mark.parametrize("model,ffn,trainer,sparse,gib", MEASURED_FLOAT8,
                         ids=[f"{m.name}x{m.n_layers}-{f}-{'graphed' if t.cuda_graph else 'eager'}"
                              for m, f, t, _, _ in MEASURED_FLOAT8])
def test_estimate_matches_the_measured_float8_peaks(model, ffn, trainer, sparse, gib):
    phases = (False, True) if ffn == "srelu24" else (None,)
    peaks = {s: estimate(model, FFNConfig(kind=ffn), 8192, trainer, world_size=1, sparse_2to4=s).peak for s in phases}
    assert max(peaks, key=peaks.get) == sparse  # the phase of the run's peak
    assert peaks[sparse] / GiB == pytest.approx(gib, rel=0.05)


@pytest.mark.parametrize("model,ffn,trainer,sparse,gib", MEASURED,
                         ids=[f"{m.name}x{m.n_layers}-{f}-{'2to4' if s else 'dense'}-{t.strategy.value}"
                              for m, f, t, s, _ in MEASURED])
def test_estimate_matches_the_measured_peaks(model, ffn, trainer, sparse, gib):
    e = estimate(model, FFNConfig(kind=ffn), V, trainer, world_size=1, sparse_2to4=sparse)
    # the requirement is 15%; the calibrated estimate is within 5% of every one of these
    assert e.peak / GiB == pytest.approx(gib, rel=0.05)


def saved_bytes_per_token(monkeypatch, kind: str, recipe: Float8, statistics: bool, sparse: bool = False,
                          S: int = 48) -> tuple[int, ModelConfig, int]:
    """What a compiled block keeps for its backward, per token: the backward graphs' inputs (not the
    incoming gradients) as inductor's partitioner chooses them (traced on the CPU under bf16
    autocast, not run through inductor's code generation), summed over the graphs that a step with
    statistics splits the block into. Per-token tensors only (a dimension of T tokens, or B and S),
    and not the per-row scalars (the norms' rsqrt, the attention's logsumexp: a few bytes a token).
    sparse: srelu24's 2:4 op on its CPU e4m3 path (tests/test_paired_grads.py), the block given a
    token order as the model gives it. Exact for torch's partitioner as pinned: a torch whose
    partitioner chooses otherwise fails here, and the estimate's float8 rows need a look. One
    difference from the GPU: torchao casts a float8 linear's input to bf16 only under CUDA's
    autocast, so here its casts read fp32; they are remade, not kept, either way
    (test_a_compiled_float8_block_on_the_gpu_keeps_what_the_cpu_trace_says checks on a GPU)."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from helpers import cpu_scaled_mm_runs
    from model import Transformer
    from model.transformer import rope_tables
    from srelu24_kernels.srelu24.reference import random_token_orders
    from training import float8

    if recipe != Float8.none and not cpu_scaled_mm_runs(recipe.value):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run {recipe.value} (torch 2.13 does)")
    if sparse:
        from test_paired_grads import _e4m3_path_on_the_cpu

        _e4m3_path_on_the_cpu(monkeypatch)
    m = ModelConfig(name="small", dim=256, n_layers=1, n_heads=4, swiglu_hidden=512)
    B = 2  # S = 48: T = 96 tokens, no weight or head dimension of that size (S = 64: T = 128)
    T, kept = B * S, []

    def partition(joint, inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        for n in bw.graph.find_nodes(op="placeholder"):
            v = n.meta.get("val")
            if (not n.name.startswith("tangents") and isinstance(v, torch.Tensor) and v.dim()
                    and (v.shape[0] in (B, T) or T in v.shape)):
                kept.append(v.numel() * v.element_size() // T)
        return fw, bw

    torch._dynamo.reset()
    # rowwise's conversion sets two inductor settings for the process: restored on leaving
    with inductor_config.patch({"emulate_precision_casts": False, "triton.prefer_nd_tiling": False}):
        model = Transformer(m, FFNConfig(kind=kind), 64, float8=recipe.value if kind == "srelu24" else "none")
        float8.convert(model, recipe, fsdp=False)
        model.set_2to4(sparse)
        block = model.layers[0]
        block.feed_forward.collect_stats = statistics
        backend = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=lambda gm, _: gm.forward,
                               partition_fn=partition, decompositions=select_decomp_table())
        x = torch.randn(B, S, m.dim, requires_grad=True)
        order = {"token_order": random_token_orders(T, 1, "cpu")[0]} if sparse else {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.compile(block, backend=backend)(x, *rope_tables(m.dim // m.n_heads, S, m.rope_theta), **order)
    torch._dynamo.reset()
    return sum(b for b in kept if b >= 64), m, T


@pytest.mark.parametrize("kind", ["srelu", "swiglu"])
@pytest.mark.parametrize("recipe,statistics", [(Float8.tensorwise, False), (Float8.tensorwise, True),
                                               (Float8.rowwise, False), (Float8.rowwise, True)])
def test_a_compiled_float8_block_keeps_what_the_estimate_counts(monkeypatch, kind, recipe, statistics):
    """The float8 rows of block_activation_bytes against the partitioner's choice: a step with the
    statistics exactly; one without, less the fp32 residual after the attention that the estimate
    counts where the block keeps the output projection's bf16 result (2 bytes a d more)."""
    traced, m, T = saved_bytes_per_token(monkeypatch, kind, recipe, statistics)
    counted = block_activation_bytes(m, FFNConfig(kind=kind), False, 4, 2, recipe, True, statistics, T)
    assert counted - traced == (0 if statistics else 2 * m.dim)


@pytest.mark.parametrize("S", [48, 64])
def test_srelu24s_compiled_float8_2to4_block_keeps_what_the_estimate_counts(monkeypatch, S):
    """srelu24's 2:4 block under tensorwise: X's e4m3 cast where the op makes it (96 tokens: X in
    bf16, no multiple of 64; 128: its cast), the attention output's e4m3 cast, and (on the CPU,
    without the CUDA kernels) Z where the GPU keeps A24. Less, as above, the 2 bytes a d over-counted
    (the token order and its inverse, 8 bytes a token, fall under the trace's few-bytes filter)."""
    traced, m, T = saved_bytes_per_token(monkeypatch, "srelu24", Float8.tensorwise, True, sparse=True, S=S)
    f = FFNConfig(kind="srelu24")
    h = ffn_hidden_dim(m, f)
    counted = block_activation_bytes(m, f, True, 4, 2, Float8.tensorwise, True, True, T) - 2 * 9 / 16 * h + 2 * h
    assert counted - traced == 2 * m.dim


def test_the_bf16_block_keeps_what_the_estimate_counts(monkeypatch):
    """The calibrated bf16 row against the same trace: within 2% (it counts the fp32 residual after
    the attention, the block keeps the output projection's input and output in bf16)."""
    traced, m, T = saved_bytes_per_token(monkeypatch, "srelu", Float8.none, False)
    assert block_activation_bytes(m, FFNConfig(kind="srelu"), False, 4, 2) == pytest.approx(traced, rel=0.02)


def test_a_cuda_graphs_pool_under_compiled_float8_holds_a_step_without_statistics():
    """Under compiled float8 the eager micro-batch beside the pool (one with statistics) keeps more
    than the graph's (one without)."""
    m, f = replace(M1B, n_layers=8), FFNConfig(kind="srelu")
    t = replace(TRAIN_1B, float8=Float8.tensorwise, compile=True, cuda_graph=True)
    e = estimate(m, f, V, t)
    T = t.micro_batch_size * t.seq_len
    transient = next(v for k, v in e.parts.items() if k.startswith("largest transient"))
    pool = e.parts["CUDA graph's pool (a micro-batch's activations, kept)"]
    without = m.n_layers * T * block_activation_bytes(m, f, False, 4, 2, Float8.tensorwise, True, False, T)
    assert pool == int(without) + transient and pool - transient < e.parts["activations"]
    assert WEIGHT_COPIES not in e.parts  # float8 linears: no bf16 copies


def test_srelu24_keeps_nine_sixteenths_of_z_in_its_2to4_phase():
    m, f = replace(M1B, n_layers=4), FFNConfig(kind="srelu24")
    dense, sparse = (estimate(m, f, V, BENCH_1B, sparse_2to4=s) for s in (False, True))
    h, T = ffn_hidden_dim(m, f), BENCH_1B.micro_batch_size * BENCH_1B.seq_len
    # dense warmup: Z and A (2 bytes each); 2:4: A24 = 9/16 of Z's 2 bytes
    assert dense.parts["activations"] - sparse.parts["activations"] == m.n_layers * T * h * (4 - 2 * 9 / 16)
    srelu = estimate(m, FFNConfig(kind="srelu"), V, BENCH_1B)
    assert srelu.parts == dense.parts


def test_strategies_and_checkpointing_move_the_right_parts():
    m, f = replace(M1B, n_layers=8), FFNConfig(kind="srelu")
    one = estimate(m, f, V, TRAIN_1B, 1)
    fsdp = estimate(m, f, V, replace(TRAIN_1B, strategy=Strategy.fsdp), 8)
    for k in ("parameters (fp32)", "optimizer state (AdamW, fp32)", "gradients (fp32)"):
        assert fsdp.parts[k] == one.parts[k] // 8
    assert one.parts["optimizer state (AdamW, fp32)"] == 2 * one.parts["parameters (fp32)"]
    ddp = estimate(m, f, V, replace(TRAIN_1B, strategy=Strategy.ddp), 8)
    assert ddp.parts["DDP gradient buckets"] == one.parts["gradients (fp32)"] and ddp.peak > one.peak
    full = estimate(m, f, V, replace(TRAIN_1B, activation_checkpointing=ActivationCheckpointing.full), 1)
    T = TRAIN_1B.micro_batch_size * TRAIN_1B.seq_len
    assert full.parts["activations"] == m.n_layers * 4 * m.dim * T  # each block's fp32 input
    selective = estimate(m, f, V, replace(TRAIN_1B, activation_checkpointing=ActivationCheckpointing.selective), 1)
    assert full.parts["activations"] < selective.parts["activations"] < one.parts["activations"]
    # without accumulation the gradients come as activations go: less than with accumulation
    assert estimate(m, f, V, replace(TRAIN_1B, batch_size=8), 1).peak < one.peak
    bigger = estimate(m, f, V, replace(TRAIN_1B, micro_batch_size=16), 1)
    assert bigger.parts["activations"] == 2 * one.parts["activations"]


def test_a_cuda_graph_adds_a_micro_batchs_activations_and_keeps_the_gradients():
    """trainer.cuda_graph: the graph's pool holds a micro-batch's activations and transient beside the
    eager ones (a logged step's), and .grad lives through the run, also without accumulation."""
    m, f = replace(M1B, n_layers=8), FFNConfig(kind="srelu24")
    for train in (TRAIN_1B, replace(TRAIN_1B, batch_size=8)):
        eager, graphed = estimate(m, f, V, train, 1), estimate(m, f, V, replace(train, cuda_graph=True), 1)
        transient = next(v for k, v in graphed.parts.items() if k.startswith("largest transient"))
        pool = graphed.parts["CUDA graph's pool (a micro-batch's activations, kept)"]
        assert pool == graphed.parts["activations"] + transient + graphed.parts.get(WEIGHT_COPIES, 0)
        if train.batch_size > train.micro_batch_size:  # accumulation: .grad was resident already
            assert graphed.peak == eager.peak + pool
        else:  # the gradients resident now, the transient's gradient of the head no longer counted twice
            assert eager.peak + pool < graphed.peak < eager.peak + pool + graphed.parts["gradients (fp32)"]


def test_checkpoint_bytes_are_weights_and_adamw():
    """The dry run's checkpoint size is training/checkpoint.py's (one definition; measured against
    real checkpoints in tests/test_checkpoint.py): 12 bytes per fp32 parameter (weights, two AdamW
    moments) plus small per-tensor and per-rank overhead."""
    m = replace(M1B, n_layers=2)
    e = estimate(m, FFNConfig(kind="srelu"), V, TRAIN_1B)
    size = checkpoint_bytes(_meta_model(m, FFNConfig(kind="srelu"), V))
    assert 0 <= size - 3 * e.parts["parameters (fp32)"] < 1e6


@background
def launches(ctx):
    """The dry run, launched with the session (helpers.background)."""
    return {"test_dry_run_prints_the_memory_estimate": lambda: run_train(
        ["+experiment=sparse_1b", "trainer.dry_run=true", "trainer.strategy=fsdp",
         "trainer.activation_checkpointing=full"], timeout=120)}


def test_dry_run_prints_the_memory_estimate(launched):
    r = launched["test_dry_run_prints_the_memory_estimate"].result()
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "1 GPU(s), strategy fsdp, activation checkpointing full, micro-batch 8 x 2048" in out
    e = estimate(M1B, FFNConfig(kind="srelu24"), V, replace(TRAIN_1B, strategy=Strategy.fsdp,
                 activation_checkpointing=ActivationCheckpointing.full), sparse_2to4=True)
    assert "peak (srelu24 2:4)" in out and f"{e.peak / GiB:.1f} GiB" in out
    for part in ("peak (srelu24 dense warmup)", "parameters (fp32)", "optimizer state (AdamW, fp32)",
                 "gradients (fp32)", "FSDP all-gathered bf16 weights", "activations", "largest transient",
                 "checkpoint size (weights + AdamW)"):
        assert part in out, part


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", ["srelu", "srelu24"])
def test_estimate_against_a_real_step_on_the_gpu(ffn):
    """1B shapes, 4 layers, micro-batch 8 x 2048, compiled, bf16 autocast, three steps."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from training.config import OptimConfig
    from training.distributed import Dist, build_model
    from training.optim import build_optimizer
    from model import Transformer

    m, f, t = replace(M1B, n_layers=4), FFNConfig(kind=ffn), replace(BENCH_1B, compile=True)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    model, step_module = build_model(lambda: Transformer(m, f, V), t, Dist(device=device), 0, False)
    model.set_2to4(ffn == "srelu24")
    opt = build_optimizer(model, OptimConfig(), device)
    for _ in range(3):
        x = torch.randint(0, V, (t.micro_batch_size, t.seq_len + 1), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_module(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = (torch.cuda.max_memory_allocated(device) - base) / GiB
    e = estimate(m, f, V, t, sparse_2to4=ffn == "srelu24")
    print(f"{ffn}: measured {measured:.2f} GiB, estimated {e.peak / GiB:.2f} GiB")
    assert e.peak / GiB == pytest.approx(measured, rel=0.15)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["srelu", "swiglu"])
@pytest.mark.parametrize("statistics", [False, True])
def test_a_compiled_float8_block_on_the_gpu_keeps_what_the_cpu_trace_says(kind, statistics):
    """The CPU trace's premise (test_a_compiled_float8_block_keeps_what_the_estimate_counts): inductor
    on CUDA keeps the same tensors. One 1B block, 8 x 2048 tokens, tensorwise: the bytes a compiled
    forward leaves allocated (its output aside), plus its input, against block_activation_bytes, less
    the 2 bytes a d that the estimate over-counts without statistics."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or newer (float8)")
    from model import Transformer
    from model.transformer import rope_tables
    from training import float8

    m, B, S = replace(M1B, n_layers=1), 8, 2048
    T, device = B * S, torch.device("cuda", torch.cuda.current_device())
    torch._dynamo.reset()
    model = Transformer(m, FFNConfig(kind=kind), V).to(device)
    float8.convert(model, Float8.tensorwise, fsdp=False)
    block = model.layers[0]
    block.feed_forward.collect_stats = statistics
    compiled = torch.compile(block)
    cos, sin = (t.to(device) for t in rope_tables(m.dim // m.n_heads, S, m.rope_theta))
    x = torch.randn(B, S, m.dim, device=device, requires_grad=True)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return compiled(x, cos, sin)

    forward().sum().backward()  # compiled, and the weights' .grad allocated
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    y = forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated(device) - before - y.numel() * y.element_size() + x.numel() * x.element_size()
    counted = block_activation_bytes(m, FFNConfig(kind=kind), False, 4, 2, Float8.tensorwise, True, statistics) * T
    print(f"{kind}, statistics {statistics}: kept {kept / T:.0f} B a token, counted {counted / T:.0f}")
    assert kept == pytest.approx(counted - (0 if statistics else 2 * m.dim * T), rel=0.02)
    torch._dynamo.reset()


def test_the_full_7b_without_checkpointing_that_ran_out_of_memory_is_estimated_above_one_h200():
    """sparse_7b's defaults on one H200 (139.3 GiB free) ran out of memory in their second step's
    forward with 139.5 GiB in use: the estimate must not call that a fit."""
    e = estimate(M7B, FFNConfig(kind="srelu24"), V, replace(TRAIN_7B_ONE_GPU, activation_checkpointing=
                                                           ActivationCheckpointing.none), sparse_2to4=False)
    assert e.peak / GiB > 139.5
