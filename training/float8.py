"""float8 training (trainer.float8: none | tensorwise | rowwise) through torchao's float8 training
API: `torchao.float8.convert_to_float8_training` with `Float8LinearConfig.from_recipe_name(recipe)`
swaps nn.Linear modules for torchao's Float8Linear, whose three GEMMs (output, grad input, grad
weight) run in float8 through torch._scaled_mm. Parameter names do not change: checkpoints, export
and evaluation see the same model.

Which linears convert (torchtitan's module filter):
- every nn.Linear whose in and out features are both divisible by 16 (torch._scaled_mm needs that;
  the others stay bf16),
- except the output head `output`, which stays bf16 (the logits, and the loss through them).
srelu24's w1 and w2 convert like the rest (its dense warmup runs them as Float8Linear). In its 2:4
phase the custom op reads their weights directly and takes the recipe from its own options, which
the model is built with (`Transformer(..., float8=)`; `convert` checks they agree): the op's two
dense GEMMs (Z = X W1^T, dA = dY W2) then run in float8, scaled as torchao scales
(srelu24_kernels/float8/gemm.py), and its four 2:4 GEMMs in e4m3 with row-wise power-of-2 scales under
either recipe (srelu24_kernels/float8/sparse.py; ffn.sparse_float8=false keeps them bf16). Its PyTorch
reference path (ffn.kernels=false) stays bf16.

The recipes are torchao's (Float8LinearConfig.from_recipe_name):
- tensorwise: one scale per tensor, e4m3 forward and e5m2 gradients; with FSDP2 the converted
  weights are cast to float8 before the all-gather (enable_fsdp_float8_all_gather: half the
  bytes), and `float8_after_optimizer_step(model)` after each optimizer step computes all their
  scales in one all-reduce (precompute_float8_dynamic_scale_for_fsdp; without it each weight's
  scale is its own small all-reduce: the same numbers, slower);
- rowwise: one scale per row, rounded down to a power of 2, e4m3 everywhere; all-gathers bf16
  (torchao has no float8 all-gather for it).
srelu24's weights all-gather bf16 under either recipe: its custom op takes plain weights.

Order (training/distributed.build_model, torchtitan's): on the meta device, float8 conversion
first, then activation checkpointing, torch.compile, sharding; then materialisation.

Needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, later): elsewhere `check`
raises ConfigError naming the setting. torch.compile (trainer.compile) fuses the casts into the
surrounding kernels; without it float8 is correct but slower. Under rowwise, `convert` also sets
two of inductor's options for the whole process: emulate_precision_casts (compiled casts round as
eager's, as torchtitan sets it) and triton.prefer_nd_tiling (the casts' transposed copies tiled in
2-D: the same bits, a faster swiglu rowwise step; lab/LOG.md).
"""
import os

import torch
import torch.nn as nn

from srelu24_kernels.float8 import scaled_mm_shapes

from .config import Float8
from .errors import ConfigError

HEAD = "output"  # the output head's module name (model/transformer.py): stays bf16


def check(recipe: Float8, device: torch.device) -> None:
    """ConfigError unless float8 GEMMs run on `device` (CUDA, compute capability >= 8.9)."""
    if recipe == Float8.none:
        return
    fix = "set trainer.float8=none"
    if device.type != "cuda":
        raise ConfigError(f"trainer.float8={recipe.value} needs a CUDA GPU of compute capability 8.9 or newer "
                          f"(float8 tensor cores); this run is on {device.type}: {fix}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"trainer.float8={recipe.value} needs a GPU of compute capability 8.9 or newer (float8 "
                          f"tensor cores); {torch.cuda.get_device_name(device)} is {major}.{minor}: {fix}")


def converts(module: nn.Module, fqn: str) -> bool:
    """torchtitan's filter: linears with both dims divisible by 16, not the output head."""
    return isinstance(module, nn.Linear) and fqn != HEAD and scaled_mm_shapes(module.in_features, module.out_features)


def convert(model: nn.Module, recipe: Float8, fsdp: bool) -> None:
    """Swap the linears that `converts` picks for torchao's Float8Linear (in place, on any device,
    the meta device included). srelu24's op takes the recipe from its options, which the model was
    built with (Transformer(..., float8=)): a model built for another recipe is a ValueError. No
    hardware check: `check`."""
    from model.ffn import SReLU24

    srelu24 = {name: m for name, m in model.named_modules() if isinstance(m, SReLU24)}
    for name, m in srelu24.items():
        want = recipe.value if converts(m.w1, f"{name}.w1") and converts(m.w2, f"{name}.w2") else "none"
        if m.options.float8 != want:
            raise ValueError(f"{name}: srelu24's op was built for float8={m.options.float8}, the trainer runs "
                             f"{recipe.value}: build the model with Transformer(..., float8={recipe.value!r})")
    if recipe == Float8.none:
        return
    # The float8 training path is Python + torch._scaled_mm; torchao's compiled extensions (other
    # quantization kernels) are not needed, and ones built for another torch can abort the process
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe.value)
    if recipe == Float8.rowwise:
        import torch._inductor.config

        # as torchtitan does: inductor's float8 casts round as eager's (pytorch/pytorch#150859)
        torch._inductor.config.emulate_precision_casts = True
        # rowwise casts X, W and dY along both axes and writes half of the casts transposed; N-D
        # tiling tiles those copies well (same bits, a faster step). bf16's step and
        # tensorwise's casts gained nothing from it (lab/LOG.md), so only here.
        torch._inductor.config.triton.prefer_nd_tiling = True
    theirs = {f"{name}.{w}" for name in srelu24 for w in ("w1", "w2")}
    gather = fsdp and recipe == Float8.tensorwise
    convert_to_float8_training(model, config=replace(config, enable_fsdp_float8_all_gather=gather),
                               module_filter_fn=lambda m, fqn: converts(m, fqn) and fqn not in theirs)
    # srelu24's never all-gather float8: its custom op takes the plain weight
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: converts(m, fqn) and fqn in theirs)
    model.float8_scales_after_step = gather


def float8_after_optimizer_step(model: nn.Module) -> None:
    """Call after every optimizer step. With FSDP2 and tensorwise float8 all-gather: the next
    all-gathers' weight scales, all in one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp).
    Otherwise nothing."""
    if getattr(model, "float8_scales_after_step", False):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
