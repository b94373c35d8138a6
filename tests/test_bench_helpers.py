"""The benchmark scripts' helpers that run on CPU: the FFN inputs' pre-activation density, the
kernel categories of the step figure (the clock sampler: tests/test_gpu_clocks.py)."""
import pytest
import torch

from helpers import BASE_ENV, background
from scripts.ffn_inputs import ffn_inputs


@background
def launches(ctx):
    """The checks of the tests that launch the scripts (helpers.background); each test waits for
    its own."""
    tmp = ctx.tmp("replot")
    jobs = {"test_bench_step_names_a_bad_variant_and_refuses_to_replot_what_it_cannot":
            lambda: check_bench_step_names_a_bad_variant_and_refuses_to_replot_what_it_cannot(tmp),
            "test_bench_step_refuses_an_unknown_precision_and_float8_on_a_cpu_in_one_line":
            check_bench_step_refuses_an_unknown_precision_and_float8_on_a_cpu_in_one_line,
            "test_bench_ffn_refuses_a_density_outside_0_1_before_any_gpu_work":
            check_bench_ffn_refuses_a_density_outside_0_1_before_any_gpu_work,
            "test_bench_ffn_refuses_fewer_than_one_round": check_bench_ffn_refuses_fewer_than_one_round}
    return jobs


@pytest.mark.parametrize("density", [0.5, 0.1, 0.02])
def test_ffn_inputs_give_the_asked_fraction_of_positive_pre_activations(density):
    torch.manual_seed(0)
    x, dy, w1, w2 = ffn_inputs(256, 1024, 512, density=density, device="cpu")
    z = (x.float() @ w1.float().t())
    got = (z > 0).float().mean().item()
    assert abs(got - density) < 0.1 * density + 0.005, got
    per_feature = (z > 0).float().mean(0)  # every feature as sparse, not a few dead ones
    assert per_feature.std().item() < 3 * (density * (1 - density) / 512) ** 0.5 + 0.01


def test_ffn_inputs_default_is_about_half_positive_and_refuses_a_bad_density():
    torch.manual_seed(0)
    x, _, w1, _ = ffn_inputs(256, 1024, 512, device="cpu")
    assert abs((x.float() @ w1.float().t() > 0).float().mean().item() - 0.5) < 0.02
    with pytest.raises(ValueError, match=r"density .* in \(0, 1\); got 1.5"):
        ffn_inputs(8, 8, 8, density=1.5, device="cpu")


def test_profiled_kernels_fall_into_the_step_figures_categories():
    from training.plots import close, kernel_category, step_kernels

    assert kernel_category("sm90_xmma_sparse_gemm_bf16bf16_bf16f32_f32_tt_t_tilesize128x256x64") == "2:4 sparse GEMMs"
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "dense GEMMs"
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert kernel_category("(anonymous namespace)::backward_operands_kernel(unsigned short const*") == "srelu24 kernels"
    assert kernel_category("triton_poi_fused__to_copy_1") == "fused elementwise (Inductor)"
    assert kernel_category("Memset (Device)") == "other"
    row = {"ffn": "srelu24", "model": "7b", "n_layers": 8, "micro_batch": 2, "seq_len": 4096, "step_ms": 168.0,
           "clocks": {"sm_clock_mhz": 1560.0},
           "top_kernels": [["sm90_xmma_sparse_gemm_x", 32.2, 32], ["nvjet_y", 72.5, 80], ["Memset (Device)", 0.3, 269]]}
    fig = step_kernels([row, {**row, "ffn": "srelu", "clocks": {}}, {"ffn": "swiglu"}])  # no profile: no bar
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["srelu24", "srelu"]
    assert any("1560 MHz" in t.get_text() for t in ax.texts)
    close(fig)


def run_bench_step(*args):
    import subprocess
    import sys

    from helpers import ROOT
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), *args],
                          capture_output=True, text=True, env=BASE_ENV, timeout=120)


def test_bench_step_names_a_bad_variant_and_refuses_to_replot_what_it_cannot(launched):
    launched["test_bench_step_names_a_bad_variant_and_refuses_to_replot_what_it_cannot"].result()


def check_bench_step_names_a_bad_variant_and_refuses_to_replot_what_it_cannot(tmp_path):
    r = run_bench_step("--ffns", "srelu,sparse", "+experiment=demo")
    assert r.returncode != 0 and "--ffns: unknown variant(s) ['sparse']" in r.stderr and "srelu24" in r.stderr
    other = tmp_path / "bench_ffn.json"
    other.write_text('{"fwbw": []}')
    r = run_bench_step("--replot", str(other))
    assert r.returncode != 0 and "is not a bench_step.py result" in r.stderr
    unprofiled = tmp_path / "bench_step.json"
    unprofiled.write_text('{"results": [{"ffn": "srelu"}]}')
    r = run_bench_step("--replot", str(unprofiled))
    assert r.returncode != 0 and "has no kernel profile (run with --profile STEPS)" in r.stderr


def test_throughput_logs_the_interval_clock_when_given_a_sampler():
    import torch

    from training.metrics import Throughput

    class Sampler:
        def __init__(self, answers):
            self.answers, self.calls = answers, []

        def take(self):
            return self.answers.pop(0)

        def pause(self):
            self.calls.append("pause")

        def resume(self):
            self.calls.append("resume")

    sampler = Sampler([{"samples": 4, "sm_clock_mhz": 1560.0, "power_w": 691.0, "energy_j": 3.0, "gpu_busy_pct": 96.0,
                        "mem_clock_mhz": 2619.0},
                       {"error": "no samples", "energy_j": 1.0}])
    m = Throughput(torch.device("cpu"), 100, 1000, world_size=2, clocks=sampler)
    m.step()
    m.step()
    m.pause()  # an evaluation: out of the interval's time and of its GPU readings
    m.pause()  # a second pause: nothing more
    m.resume()
    m.resume()
    row = m.read()
    assert row["gpu_sm_clock_mhz"] == 1560.0 and row["gpu_power_w"] == 691.0 and sampler.calls == ["pause", "resume"]
    # this GPU's 3 J over its share of 2 steps x 1000 tokens on 2 GPUs
    assert row["gpu_energy_j"] == 3.0 and row["gpu_mj_per_token"] == pytest.approx(3.0)
    assert row["gpu_busy_pct"] == 96.0 and row["gpu_mem_clock_mhz"] == 2619.0
    m.step()
    assert not {"gpu_sm_clock_mhz", "gpu_energy_j", "gpu_busy_pct", "gpu_mem_clock_mhz"} & set(m.read())  # an interval without samples logs nothing
    assert "gpu_sm_clock_mhz" not in Throughput(torch.device("cpu"), 100, 10).read()


def test_bench_ffn_refuses_a_density_outside_0_1_before_any_gpu_work(launched):
    launched["test_bench_ffn_refuses_a_density_outside_0_1_before_any_gpu_work"].result()


def check_bench_ffn_refuses_a_density_outside_0_1_before_any_gpu_work():
    import subprocess
    import sys

    from helpers import ROOT
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ffn.py"), "--density", "1.5"],
                       capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode == 2 and "--density is the fraction of positive pre-activations, in (0, 1); got 1.5" in r.stderr


def test_rounds_time_every_variant_once_a_round_in_alternating_order():
    from training.gpu_clocks import interleaved_rounds

    order = []
    times = iter(range(100))

    def timer(run):
        order.append(run)
        return next(times)

    got = interleaved_rounds({"a": "A", "b": "B", "c": "C"}, 3, timer)
    assert order == list("ABCCBAABC")
    assert got == {"a": [0, 5, 6], "b": [1, 4, 7], "c": [2, 3, 8]}


def test_bench_ffn_refuses_fewer_than_one_round(launched):
    launched["test_bench_ffn_refuses_fewer_than_one_round"].result()


def check_bench_ffn_refuses_fewer_than_one_round():
    import subprocess
    import sys

    from helpers import ROOT
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ffn.py"), "--repeats", "0"],
                       capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode == 2 and "--repeats is the number of rounds of the float8 part, >= 1; got 0" in r.stderr


def test_bench_steps_clock_reads_every_step_once_after_the_last():
    """bench_step's Clock: the marks of several steps, read in one go (no sync between steps),
    summed per phase (two micro-batches), each step's row once."""
    import time

    from scripts.bench_step import Clock

    c = Clock(torch.device("cpu"))
    for _ in range(3):
        c.start()
        for phase in ("data", "forward", "backward", "data", "forward", "backward", "optimizer"):
            time.sleep(0.002)
            c.mark(phase)
    rows = c.phases_ms()
    assert len(rows) == 3 and c.phases_ms() == []
    for data, fw, bw, op in rows:
        assert min(data, fw, bw) >= 3.5 and op >= 1.5  # two marks each, one for the optimizer


def test_bench_step_refuses_an_unknown_precision_and_float8_on_a_cpu_in_one_line(launched):
    launched["test_bench_step_refuses_an_unknown_precision_and_float8_on_a_cpu_in_one_line"].result()


def check_bench_step_refuses_an_unknown_precision_and_float8_on_a_cpu_in_one_line():
    r = run_bench_step("--precisions", "none,fp8", "+experiment=demo")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1
    assert lines[0] == ("error: --precisions: unknown value(s) ['fp8']; valid: a comma-separated list of none, "
                        "tensorwise, rowwise")
    r = run_bench_step("--precisions", "none,tensorwise", "--device", "cpu", "+experiment=demo", "--layers", "1")
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("srelu24: using")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: --precisions: trainer.float8=tensorwise needs a CUDA GPU")
    assert "| swiglu |" not in r.stdout  # refused before any row ran


def test_rowwise_inductor_options_do_not_reach_the_next_row():
    """training/float8.convert sets two inductor options for the whole process under rowwise;
    bench_step restores them after each row."""
    import torch._inductor.config as inductor

    from scripts.bench_step import inductor_settings_restored

    before = (inductor.emulate_precision_casts, inductor.triton.prefer_nd_tiling)
    with inductor_settings_restored():
        inductor.emulate_precision_casts = not before[0]  # as a rowwise row sets them
        inductor.triton.prefer_nd_tiling = not before[1]
    assert (inductor.emulate_precision_casts, inductor.triton.prefer_nd_tiling) == before
    with pytest.raises(RuntimeError), inductor_settings_restored():  # also when the row fails
        inductor.triton.prefer_nd_tiling = not before[1]
        raise RuntimeError("a row that fails")
    assert inductor.triton.prefer_nd_tiling == before[1]


def test_the_clocks_line_names_a_waiting_gpu(tmp_path, capsys):
    """bench_step's clock line gives NVML's GPU busy % where the card reports it."""
    import types

    from scripts import bench_step
    args = types.SimpleNamespace(out=tmp_path / "r.json", override=["+experiment=demo"], print_kernels=3)
    row = {"ffn": "srelu24", "precision": "tensorwise", "n_layers": 1, "layers_cut_from": None, "world_size": 1,
           "strategy": "none", "micro_batch": 2, "seq_len": 8, "accum": 1, "step_ms": 1.0, "data_ms": 0.0,
           "forward_ms": 0.5, "backward_ms": 0.4, "optimizer_ms": 0.1, "tokens_per_s": 10.0, "mfu": None,
           "peak_mem_gib": None, "estimated_peak_gib": 0.1, "step_j": 5.0, "commit": "abc1234", "dirty": False,
           "clocks": {"samples": 3, "sm_clock_mhz": 1500.0, "power_w": 600.0, "gpu_busy_pct": 71.0}}
    dense = dict(row, ffn="srelu", clocks={"samples": 3, "sm_clock_mhz": 1600.0, "power_w": 690.0})
    bench_step.report(args, [dense, row], torch.device("cpu"))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("clocks over the timed steps"))
    assert line.endswith("srelu24 tensorwise 1500.0 MHz, 600.0 W, 5.0 J/step, GPU busy 71%")
    assert "690.0 W, 5.0 J/step;" in line  # no busy figure where the card gave none
