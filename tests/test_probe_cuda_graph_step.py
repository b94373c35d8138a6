"""lab/probe_cuda_graph_step.py's bookkeeping on the CPU (its "graph" calls the captured function
again): the replayed step's fixed buffers (tokens, token orders, .grad added into in place) give
the eager step's gradients, and its check notices gradients from other token orders. The capture
itself needs a GPU."""
import json
import subprocess
import sys

from helpers import ROOT

ARGS = ["+experiment=demo", "--device", "cpu", "--no-compile", "--layers", "1", "--steps", "1", "--warmup", "1",
        "--ffns", "srelu24", "logging.wandb.mode=disabled"]
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


def test_replayed_step_gives_the_eager_gradients_and_the_check_can_fail(tmp_path):
    out = tmp_path / "ok.json"
    r = subprocess.run([sys.executable, str(ROOT / "lab" / "probe_cuda_graph_step.py"), *ARGS, "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    c = check(out)
    assert c["eager_vs_graph"]["params"] > 0 and c["eager_vs_graph"]["differ"] == 0
    assert c["loss_graph"] == c["loss_eager"] == c["loss_eager_again"]
    assert "| srelu24 |" in r.stdout
    bad = tmp_path / "bad.json"
    code = WRONG_ORDERS.format(lab=str(ROOT / "lab"), args=[*ARGS, "--out", str(bad)])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    c = check(bad)
    assert c["eager_vs_eager"]["differ"] == 0 and c["eager_vs_graph"]["differ"] > 0
