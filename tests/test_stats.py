"""Per-layer activation statistics against direct computation, and the real wandb run."""
import json
import math

import pytest
import torch

from helpers import background, compose_config, run_train, tiny_overrides, with_cache, write_corpus
from model import FFN_REGISTRY, FFNConfig, ModelConfig, Transformer
from srelu24_kernels.srelu24.reference import mask_2to4
from srelu24_kernels.ffn_stats import (DENSE_FEATURE_DENSITY, N_SUMS, SWIGLU_ZERO_THRESHOLD, dense_activation_sums, derive,
                         srelu24_sums)
from training.metrics import PEAK_BF16_TFLOPS, Throughput, peak_flops


def test_dense_sums_on_a_known_tensor():
    a = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    stats = derive(dense_activation_sums(a)[None], srelu24=False)
    assert stats == {"act_sparsity": [5 / 8]}


def test_swiglu_threshold_counts_small_magnitudes():
    t = SWIGLU_ZERO_THRESHOLD
    a = torch.tensor([[t / 2, -t / 2, 2 * t, -3 * t]])
    assert derive(dense_activation_sums(a, t)[None], srelu24=False)["act_sparsity"] == [0.5]


def test_srelu24_sums_on_a_known_tensor():
    # 4 tokens x 8 features; feature 0 is dense along tokens, the rest sparse
    a = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 5.0],
                      [4.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0],
                      [4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [4.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    mask = mask_2to4(a)
    for sparse in (False, True):
        s = derive(srelu24_sums(a, mask, dense_fraction=0.25, sparse=sparse)[None], srelu24=True)
        fed = a * mask if sparse else a
        assert s["act_sparsity"] == [pytest.approx((fed == 0).float().mean().item())]
        dropped = (a != 0) & ~mask
        assert s["drop_nnz"] == [pytest.approx(dropped.sum().item() / (a != 0).sum().item())]
        assert s["drop_l2"] == [pytest.approx(((a * ~mask).norm() / a.norm()).item())]
        density = (fed != 0).float().mean(0)
        assert s["dense_features"] == [pytest.approx((density > DENSE_FEATURE_DENSITY).float().mean().item())]
        assert s["split_density"] == [pytest.approx(density.sort(descending=True).values[1].item())]  # k = 2
        assert s["mode_2to4"] == [float(sparse)]
    # by hand: 13 non-zeros; 2:4 drops the 2 and 1 of row 0's [4,3,2,1] and the third 1 of row 1's
    # [1,1,1,0] (ties go to the lower index)
    s = derive(srelu24_sums(a, mask, 0.25, sparse=True)[None], srelu24=True)
    assert s["drop_nnz"] == [pytest.approx(3 / 13)]
    assert s["dense_features"] == [pytest.approx(1 / 8)]  # only feature 0 is above 50% density


def test_derive_averages_over_passes_and_sums_counts():
    a = torch.relu(torch.randn(64, 32)) ** 2
    b = torch.relu(torch.randn(64, 32) - 1) ** 2
    rows = srelu24_sums(a, mask_2to4(a), 0.05, True) + srelu24_sums(b, mask_2to4(b), 0.05, True)
    s = derive(rows[None], srelu24=True)
    both = torch.cat([a * mask_2to4(a), b * mask_2to4(b)])
    assert s["act_sparsity"] == [pytest.approx((both == 0).float().mean().item())]
    assert s["mode_2to4"] == [1.0]


def test_counts_stay_exact_above_float32_integers():
    row = torch.zeros(N_SUMS, dtype=torch.float64)
    row[0], row[1] = 2**25 + 1, 2**24 + 1
    assert derive(row[None], False)["act_sparsity"] == [(2**24 + 1) / (2**25 + 1)]


@pytest.mark.parametrize("kind", list(FFN_REGISTRY))
def test_model_collects_per_layer_stats_only_when_asked(kind):
    torch.manual_seed(0)
    m = Transformer(ModelConfig(dim=64, n_layers=3, n_heads=2, swiglu_hidden=128), FFNConfig(kind=kind), 100)
    x = torch.randint(0, 100, (2, 16))
    m(x, x).backward()
    assert m.pop_ffn_stats().abs().sum() == 0  # nothing collected while off
    m.collect_ffn_stats(True)
    acts = []
    hooks = [layer.feed_forward.w2.register_forward_pre_hook(lambda mod, inp: acts.append(inp[0].detach()))
             for layer in m.layers]
    m(x, x).backward()
    for h in hooks:
        h.remove()
    stats = derive(m.pop_ffn_stats(), kind == "srelu24")
    thr = SWIGLU_ZERO_THRESHOLD if kind == "swiglu" else 0.0
    want = [(a.abs() <= thr).float().mean().item() for a in acts]
    assert stats["act_sparsity"] == pytest.approx(want)
    assert m.pop_ffn_stats().abs().sum() == 0  # popping resets


def test_no_mfu_on_cpu_and_peak_table():
    assert peak_flops(torch.device("cpu")) is None
    assert PEAK_BF16_TFLOPS["H100"] == PEAK_BF16_TFLOPS["H200"] == 989.0 and PEAK_BF16_TFLOPS["A100"] == 312.0
    meter = Throughput(torch.device("cpu"), flops_per_token=100, tokens_per_step=1000)
    for _ in range(3):
        meter.step()
    out = meter.read()
    assert "mfu" not in out and out["tokens_per_s"] > 0
    assert out["step_time_s"] * 3 == pytest.approx(3000 / out["tokens_per_s"])


def test_ffn_stats_every_keeps_the_statistics_to_those_logged_steps(tmp_path, corpus, cache):
    """trainer.ffn_stats_every=3 with every step logged: every row has the loss, only steps 3 and 6
    and the last (8) have the per-layer statistics."""
    from training.loop import train

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = with_cache(tiny_overrides(tmp_path, corpus, ["ffn=srelu24", "ffn.dense_warmup_steps=3",
                                                        "trainer.ffn_stats_every=3", "trainer.ckpt_every=100"]), cache)
    train(compose_config([a for a in args if not a.startswith("hydra.")]), run_dir, "stats_every")
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["step"] for r in rows if "layers" in r] == [3, 6, 8]
    assert all("act_sparsity_mean" in r for r in rows if "layers" in r)


def offline_run(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    args = [a for a in tiny_overrides(tmp_path, corpus) if not a.startswith("logging.wandb.mode")]
    return run_train(args + ["ffn=srelu24", "ffn.hidden_dim=128", "ffn.dense_warmup_steps=3", "logging.wandb.mode=offline",
                             "name=statstest"], env={"WANDB_MODE": "offline"}), tmp_path


@background
def launches(ctx):
    """The wandb run, launched with the session (helpers.background)."""
    tmp = ctx.tmp("wandb")
    return {"test_offline_wandb_run_has_per_layer_keys": lambda: offline_run(tmp)}


@pytest.mark.slow
def test_offline_wandb_run_has_per_layer_keys(launched):
    from wandb_records import history_keys, run_info

    r, tmp_path = launched["test_offline_wandb_run_has_per_layer_keys"].result()
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    keys = history_keys(files[0])
    for stat in ("act_sparsity", "drop_nnz", "drop_l2", "dense_features", "split_density", "mode_2to4"):
        assert {f"{stat}/layer_00", f"{stat}/layer_01"} <= keys, stat
        assert f"charts/{stat}_table/_type" in keys  # the line-per-layer chart
    assert "charts/act_sparsity_heatmap/_type" in keys
    assert {"loss", "val_loss", "tokens", "tokens_per_s", "step_time_s", "data_wait_frac"} <= keys
    info = run_info(files[0])
    assert info["group"] == "statstest" and info["job_type"] == "srelu24"
    assert {"model", "ffn", "trainer", "run_info"} <= info["config_keys"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["layers"]["mode_2to4"] for r in rows if "layers" in r][2:4] == [[0.0, 0.0], [1.0, 1.0]]
    assert all(math.isfinite(v) for r in rows if "layers" in r for v in r["layers"]["drop_l2"])


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
def test_fused_sums_on_cuda_equal_the_eager_ones(sparse):
    """On CUDA the sums run through torch.compile: same numbers as the eager definition."""
    from srelu24_kernels.ffn_stats import _dense_sums, _srelu24_sums

    a = (torch.relu(torch.randn(4096, 1024, device="cuda") - 0.5) ** 2).bfloat16()
    mask = mask_2to4(a)
    got = srelu24_sums(a, mask, 0.05, sparse)
    want = _srelu24_sums(a, mask, 51, sparse)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(dense_activation_sums(a), _dense_sums(a, 0.0), rtol=0, atol=0)
