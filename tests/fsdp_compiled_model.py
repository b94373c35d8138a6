"""Run by tests/test_distributed.py under torchrun (2 CPU processes, gloo): a small model built
as the trainer builds it with trainer.compile and FSDP2 (compiled blocks and loss head), against
the same model eager and unsharded, over 4 forward + backward passes. Exits non-zero on a
mismatch or a dynamo recompile (FSDP2 swaps the root's parameters in and out around forward)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from model import FFNConfig, ModelConfig, Transformer  # noqa: E402
from training.config import Strategy, TrainerConfig  # noqa: E402
from training.distributed import build_model, exit_process, setup  # noqa: E402

t = TrainerConfig(strategy=Strategy.fsdp, compile=True, device="cpu")
d = setup(t)
cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, swiglu_hidden=128, max_seq_len=32)
model, step_module = build_model(lambda: Transformer(cfg, FFNConfig(kind="swiglu"), 97), t, d, 0, False)
ref = Transformer(cfg, FFNConfig(kind="swiglu"), 97)
torch.manual_seed(0)
ref.reset_parameters()  # build_model's weights: the seed's whole tensors, whatever the sharding
g = torch.Generator().manual_seed(d.rank)
for step in range(4):
    x, y = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
    loss = step_module(x, y)
    loss.backward()
    want = ref(x, y)
    assert torch.allclose(loss, want, rtol=1e-5, atol=1e-6), (step, loss.item(), want.item())
recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
assert recompiles == 0, dict(counters["recompiles"])
print(f"rank {d.rank}: 4 passes equal to eager, {recompiles} recompiles", flush=True)
dist.destroy_process_group()
exit_process(0)  # without the interpreter's teardown, which gloo's threads can abort (pytorch/pytorch#190489)
