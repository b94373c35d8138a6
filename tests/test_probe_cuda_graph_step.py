"""lab/probe_cuda_graph_step.py's bookkeeping on the CPU (its "graph" calls the captured function
again): the replayed step's fixed buffers (tokens, token orders, .grad added into in place) give
the eager step's gradients, and its check notices gradients from other token orders. The capture
itself needs a GPU."""
import json
import subprocess
import sys

import pytest
import torch

from helpers import BASE_ENV, ROOT, background

# 2 micro-batches (several: .grad added into in place, the step state kept) of 4 x 32 tokens
ARGS = ["+experiment=demo", "--device", "cpu", "--no-compile", "--layers", "1", "--steps", "1", "--warmup", "1",
        "--accum", "2", "--ffns", "srelu24", "logging.wandb.mode=disabled", "trainer.seq_len=32",
        "trainer.micro_batch_size=4"]
WRONG_ORDERS = """
import sys
sys.path[:0] = [{lab!r}]
import probe_cuda_graph_step as p
micro = p.GraphedMicroBatch.micro
p.GraphedMicroBatch.micro = lambda self, x, y, orders: micro(self, x, y, orders.roll(1, dims=-1))
sys.argv = ["probe", *{args!r}]
p.main()
"""


def check(out):
    (row,) = json.loads(out.read_text())["results"]
    return row["check"]


@background
def launches(ctx):
    """The two probes, the real one and one with the token orders rolled, launched with the session
    (helpers.background): (result, its JSON)."""
    tmp = ctx.tmp("probe")
    out, bad = tmp / "ok.json", tmp / "bad.json"
    code = WRONG_ORDERS.format(lab=str(ROOT / "lab"), args=[*ARGS, "--out", str(bad)])

    def probe(cmd: list[str], json_out):
        return lambda: (subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=BASE_ENV),
                        json_out)

    name = "test_replayed_step_gives_the_eager_gradients_and_the_check_can_fail"
    return {f"{name}[ok]": probe([sys.executable, str(ROOT / "lab" / "probe_cuda_graph_step.py"), *ARGS, "--out",
                                  str(out)], out),
            f"{name}[bad]": probe([sys.executable, "-c", code], bad)}


def test_replayed_step_gives_the_eager_gradients_and_the_check_can_fail(launched):
    name = "test_replayed_step_gives_the_eager_gradients_and_the_check_can_fail"
    r, out = launched[f"{name}[ok]"].result()
    assert r.returncode == 0, r.stderr[-2000:]
    c = check(out)
    assert c["eager_vs_graph"]["params"] > 0 and c["eager_vs_graph"]["differ"] == 0
    assert c["eager_vs_graph_updated"]["differ"] == 0 and c["verdict"] == "bit-identical"
    assert c["loss_graph"] == c["loss_eager"] == c["loss_eager_again"]
    assert c["loss_graph_updated"] == c["loss_eager_updated"] != c["loss_eager"]  # the weights moved in between
    assert "| srelu24 |" in r.stdout
    r, bad = launched[f"{name}[bad]"].result()
    assert r.returncode == 0, r.stderr[-2000:]
    c = check(bad)
    assert c["eager_vs_eager"]["differ"] == 0 and c["eager_vs_graph"]["differ"] > 0 and c["verdict"] == "differs"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_step_on_the_gpu_gives_the_eager_gradients_bit_for_bit(tmp_path):
    """The real capture (float8 tensorwise, compiled blocks, srelu24's e4m3 kernels and step
    state): every gradient torch.equal to the eager step's, wherever the eager step repeats itself."""
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(ROOT / "lab" / "probe_cuda_graph_step.py"), "+experiment=demo", "--layers", "2",
                        "--ffns", "srelu,srelu24", "--steps", "2", "--warmup", "1", "trainer.float8=tensorwise",
                        "logging.wandb.mode=disabled", "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for row in json.loads(out.read_text())["results"]:
        c = row["check"]
        assert c["eager_vs_eager"]["differ"] == 0, (row["ffn"], c)  # else bit-identity is not defined here
        assert c["verdict"] == "bit-identical" and c["loss_graph"] == c["loss_eager"], (row["ffn"], c)
