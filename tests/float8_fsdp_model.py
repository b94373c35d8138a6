"""Run by tests/test_float8.py under torchrun: an srelu24 model (dense warmup) built by build_model
with trainer.float8=tensorwise and FSDP2, whose attention weights all-gather in float8 and whose
srelu24 weights stay plain, against the same model unsharded, over 3 AdamW steps with
float8_after_optimizer_step. Both ranks see the same batch, so the averaged gradient is the
unsharded one's. Exits non-zero on a mismatch.

    torchrun --nproc-per-node=2 tests/float8_fsdp_model.py        # CPU (gloo, torch's CPU _scaled_mm)
    torchrun --nproc-per-node=1 tests/float8_fsdp_model.py cuda   # GPU (NCCL), compiled blocks"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from model import FFNConfig, ModelConfig, Transformer  # noqa: E402
from training import float8  # noqa: E402
from training.config import Float8, OptimConfig, Strategy, TrainerConfig  # noqa: E402
from training.distributed import Dist, build_model, exit_process, setup  # noqa: E402
from training.optim import build_optimizer  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
cuda = device == "cuda"
if not cuda:
    float8.check = lambda *a: None  # float8 on the CPU: torch's _scaled_mm there stands in for the GPU's
t = TrainerConfig(strategy=Strategy.fsdp, device=device, float8=Float8.tensorwise, compile=cuda)
d = setup(t)
cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, swiglu_hidden=128, max_seq_len=64)
make = lambda: Transformer(cfg, FFNConfig(kind="srelu24"), 96, float8="tensorwise")  # noqa: E731
model, step_module = build_model(make, t, d, 0, False)
ref, _ = build_model(make, TrainerConfig(device=device, float8=Float8.tensorwise, compile=cuda),
                     Dist(device=d.device), 0, False)

from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

wq, w1 = model.layers[0].attention.wq.weight, model.layers[0].feed_forward.w1.weight
assert isinstance(wq.to_local(), WeightWithDynamicFloat8CastTensor), type(wq.to_local())
assert type(w1.to_local()) is torch.Tensor and type(model.output.weight.to_local()) is torch.Tensor
opts = [build_optimizer(m, OptimConfig(lr=3e-3, warmup_steps=0), d.device) for m in (model, ref)]
batch = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(0)).to(d.device)  # same on all ranks
for step in range(3):
    losses = []
    for m, opt in zip((step_module, ref), opts):
        with torch.autocast(d.device.type, dtype=torch.bfloat16):
            loss = m(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float8.float8_after_optimizer_step(m)
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= (1e-3 if cuda else 1e-4) * abs(losses[1]), (step, losses)
    # the precomputed scale is the whole weight's (one all-reduce over the shards), as unsharded
    full = wq.detach().full_tensor()
    want = (torch.finfo(torch.float8_e4m3fn).max / full.abs().max().double()).float()
    got = wq._local_tensor._precomputed_scale  # to_local() is a new alias, without the attribute
    assert got is not None and torch.allclose(got, want, rtol=1e-6), (got, want)
print(f"rank {d.rank}: 3 steps equal to the unsharded model, scales of the whole weights", flush=True)
dist.destroy_process_group()
exit_process(0)  # without the interpreter's teardown, which gloo's threads can abort (pytorch/pytorch#190489)
