"""How far a short float8 loss curve strays from bf16's, over seeds: the setting of
tests/test_float8.py::test_compiled_float8_training_on_cuda_follows_bf16 (4 layers, d 512,
compiled, bf16 autocast, AdamW lr 1e-3, 20 steps over 4 fixed batches of random tokens), srelu24 in
its 2:4 phase, with the weights going into the e4m3 op as fp32 (the product) or cast to bf16 outside
it (before a855796). Prints each run's last-five mean loss and its distance from bf16's.
--grads: instead, one step's gradients of each arm (eager), against each other and against bf16's,
the largest relative distance over the parameters (a wrong gradient would stand out there, where a
trajectory's chaos cannot hide it).

    python lab/probe_float8_loss_seeds.py [--recipe tensorwise] [--seeds 8 9 10 11] [--grads]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import srelu24_ffn  # noqa: E402
from model import FFNConfig, ModelConfig, Transformer  # noqa: E402
from training import float8  # noqa: E402
from training.config import Float8, OptimConfig, TrainerConfig  # noqa: E402
from training.distributed import Dist, build_model  # noqa: E402
from training.optim import build_optimizer  # noqa: E402

FP32_IN = srelu24_ffn._op_weight


def model_for(recipe: Float8, compile: bool = True):
    cfg = ModelConfig(name="t", dim=512, n_layers=4, n_heads=8, swiglu_hidden=1536, max_seq_len=512)
    torch.manual_seed(0)  # the same initial weights in every run
    model, _ = build_model(lambda: Transformer(cfg, FFNConfig(kind="srelu24"), 1024),
                           TrainerConfig(float8=recipe, compile=compile, device="cuda"),
                           Dist(device=torch.device("cuda")), 0, False)
    model.set_2to4(True)
    return model


def one_step_grads(recipe: Float8, seed: int) -> dict:
    model = model_for(recipe, compile=False)
    batch = torch.randint(0, 1024, (8, 257), generator=torch.Generator().manual_seed(seed)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(batch[:, :-1], batch[:, 1:]).backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def worst(a: dict, b: dict) -> str:
    rel = {n: ((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)).item() for n in b}
    n = max(rel, key=rel.get)
    return f"{rel[n]:.4f} ({n}), median {sorted(rel.values())[len(rel) // 2]:.4f}"


def losses(recipe: Float8, seed: int, steps: int = 20) -> list[float]:
    device = torch.device("cuda")
    model = model_for(recipe)
    opt = build_optimizer(model, OptimConfig(lr=1e-3, warmup_steps=0), device)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 1024, (8, 257), generator=g).to(device) for _ in range(4)]
    out = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float8.float8_after_optimizer_step(model)
        out.append(loss.item())
    torch._dynamo.reset()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[8, 9, 10, 11])
    ap.add_argument("--grads", action="store_true")
    args = ap.parse_args()
    recipe = Float8(args.recipe)
    if args.grads:
        for seed in args.seeds:
            ref = one_step_grads(Float8.none, seed)
            fp32_in = one_step_grads(recipe, seed)
            srelu24_ffn._op_weight = lambda w, e4m3: w.to(torch.bfloat16)
            outside = one_step_grads(recipe, seed)
            srelu24_ffn._op_weight = FP32_IN
            print(f"seed {seed}: fp32-in vs bf16 {worst(fp32_in, ref)}; cast-outside vs bf16 {worst(outside, ref)}; "
                  f"fp32-in vs cast-outside {worst(fp32_in, outside)}", flush=True)
        return 0
    print("| seed | bf16 last 5 | fp32 weights into the op | cast to bf16 outside |")
    print("|---|---|---|---|")
    for seed in args.seeds:
        ref = sum(losses(Float8.none, seed)[-5:]) / 5
        cells = []
        for op_weight in (FP32_IN, lambda w, e4m3: w.to(torch.bfloat16)):
            srelu24_ffn._op_weight = op_weight
            got = sum(losses(recipe, seed)[-5:]) / 5
            cells.append(f"{got:.4f} ({100 * (got - ref) / ref:+.2f}%)")
        srelu24_ffn._op_weight = FP32_IN
        print(f"| {seed} | {ref:.4f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
