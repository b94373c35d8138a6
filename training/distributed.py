"""Processes and parallelism, in one place: how this process learns its rank, the process group,
and `build_model`, which applies the transforms in a fixed order (docs/DISTRIBUTED.md).

Where the ranks come from:
- torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
- else, with trainer.strategy ddp or fsdp, a SLURM step with several tasks (srun, or
  hydra-submitit-launcher with one task per GPU): SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS,
  MASTER_ADDR = the first host of SLURM_JOB_NODELIST, MASTER_PORT = 20000 + SLURM_JOB_ID % 20000
  (either can be set in the environment instead);
- else one process.
"""
import functools
import inspect
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from . import float8
from .config import ActivationCheckpointing, Strategy, TrainerConfig
from .errors import ConfigError


_joined = False  # this process has been in a process group (exit_process)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    enabled: bool = False  # a process group exists (strategy ddp / fsdp, also with one process)
    # gloo, no practical timeout: for waits that may take hours (rank 0 tokenizing a corpus), which
    # the main group's dist_timeout_s (NCCL's watchdog) would cut off
    slow_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Launch:
    rank: int
    local_rank: int
    world_size: int
    source: str  # "torchrun" | "slurm"


def launch_env(env=os.environ, slurm: bool = True) -> Optional[Launch]:
    """The ranks torchrun or a multi-task SLURM step gave this process, or None (one process).
    slurm=False ignores SLURM's variables (trainer.strategy=none: `python train.py` inside an
    allocation of several tasks is one process)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]), "torchrun")
    if slurm and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return Launch(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]), "slurm")
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-004,007],cpu1' -> 'gpu003', 'node-[01-02]-ib' ->
    'node-01-ib'. Parsed by submitit (what its SlurmJobEnvironment.hostnames uses), not by hand."""
    from submitit.slurm.slurm import SlurmParseException, _parse_node_list

    try:
        hosts = _parse_node_list(nodelist.strip())
    except SlurmParseException:
        hosts = []
    if not hosts or not hosts[0]:
        raise ConfigError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    return hosts[0]


def _slurm_rendezvous(env=os.environ) -> None:
    """MASTER_ADDR / MASTER_PORT for env:// from SLURM's variables (kept if already set)."""
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost")))
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)


def pick_device(name: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """trainer.device: auto | cpu | cuda | cuda:N. With several processes each takes cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name} but CUDA is not available; use trainer.device=cpu or auto")
    if device.type == "cuda" and world_size > 1 and device.index is not None:
        raise ConfigError(f"trainer.device={name} with {world_size} processes: use trainer.device=cuda or auto "
                          "(each process takes cuda:LOCAL_RANK)")
    if device.type == "cuda" and device.index is None:
        # an explicit index (set_device and NCCL need one, also with one process); a step that
        # binds one GPU per task shows each task only its own (device 0)
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def setup(t: TrainerConfig) -> Dist:
    """Join the process group when trainer.strategy asks for one (every rank calls this first)."""
    launch = launch_env(slurm=t.strategy != Strategy.none)
    world = launch.world_size if launch else 1
    if t.strategy == Strategy.none:
        if world > 1:
            raise ConfigError(f"{world} processes were launched ({launch.source}) but trainer.strategy=none; "
                              "valid values with several processes: ddp, fsdp")
        return Dist(device=pick_device(t.device))
    rank, local_rank = (launch.rank, launch.local_rank) if launch else (0, 0)
    device = pick_device(t.device, local_rank, world)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=t.dist_timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    global _joined
    _joined = True
    if launch is None:  # one process: a group of one, no network
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if launch.source == "slurm":
            _slurm_rendezvous()
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout, **kw)
    slow = dist.new_group(backend="gloo", timeout=timedelta(days=7)) if world > 1 else None
    return Dist(rank, local_rank, world, device, enabled=True, slow_group=slow)


def shutdown(d: Dist) -> None:
    """Leave the process group. No barrier: every rank returns from the same last collective."""
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code) -> None:
    """End a `python train.py` process with `code` (SystemExit's). After a process group, without
    the interpreter's teardown: gloo's threads may still be releasing the last collectives' tensors,
    which takes the GIL, and that aborts a process in teardown after a successful run
    (pytorch/pytorch#190489; found here with gdb, docs/DISTRIBUTED.md "Leaving the process")."""
    code = 0 if code is None else code
    if not isinstance(code, int):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    if not _joined:
        sys.exit(code)
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()  # Hydra's job log file
    os._exit(code)


# The compiled variants of a block: each phase (srelu24's dense warmup, 2:4) with and without the
# FFN statistics, evaluation (no grad), and in the 2:4 phase under srelu24's step state a step's first
# micro-batch (no .grad to add into yet) and the later ones, each twice with ffn.paired_grad_unscaling
# (a pair's first and second). One CPU run of every case without pairing reached 8, torch's default
# limit, past which dynamo runs the block eagerly for the rest of the run. The limit counts per code
# object: a checkpointed block's variants are the `checkpointed` wrapper's (5 in a CPU run of every
# phase, with statistics and evaluation), its other blocks' Block.forward's.
BLOCK_RECOMPILE_LIMIT = 16


def build_model(make, t: TrainerConfig, d: Dist, seed: int, bf16_params: bool) -> tuple[nn.Module, nn.Module]:
    """Build on the meta device, then transform in this order (torchtitan's):
    1. float8 conversion of the linears (trainer.float8, training/float8.py),
    2. activation checkpointing (trainer.activation_checkpointing),
    3. torch.compile of each block and of the loss head (trainer.compile),
    4. sharding: fully_shard of each block, then of the root (fsdp),
    5. materialise: to_empty on the device, then the model's own reset_parameters from `seed`
       (whole tensors from the CPU RNG: the same weights for any strategy and world size),
    6. DistributedDataParallel around it (ddp).
    Returns (model, train_module): the model (its parameter names never change: checkpoints,
    export and evaluation use it) and what a training step calls (DDP's wrapper, or the model)."""
    float8.check(t.float8, d.device)  # before any work: a one-line error where float8 cannot run
    with torch.device("meta"):
        model = make()
    float8.convert(model, t.float8, fsdp=t.strategy == Strategy.fsdp)
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, BLOCK_RECOMPILE_LIMIT)
        for block in model.layers:
            block.compile()  # in place: parameter names stay as they are (no _orig_mod.)
        model.loss = torch.compile(model.loss)  # norm + output + cross-entropy fused, on the instance
    if t.strategy == Strategy.fsdp:
        shard(model, d, bf16_params)
    model.to_empty(device=d.device)
    torch.manual_seed(seed)
    model.reset_parameters()
    if t.strategy == Strategy.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # buffers are not synced per forward: RoPE tables are equal everywhere, statistics are per rank
        ids = [d.device.index] if d.device.type == "cuda" else None
        sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                else {"broadcast_buffers": False})  # the older name (torch < 2.13)
        return model, DDP(model, device_ids=ids, **sync)
    return model, model


def apply_activation_checkpointing(model: nn.Module, mode: ActivationCheckpointing) -> None:
    """selective: blocks 0, 2, 4, ...; full: every block. The block's forward is replaced on the
    instance, so parameter names (state dicts, checkpoints) are unchanged. A recomputed forward adds
    its activation statistics a second time to both numerator and denominator: ratios are unchanged."""
    blocks = {ActivationCheckpointing.none: [], ActivationCheckpointing.selective: list(model.layers)[::2],
              ActivationCheckpointing.full: list(model.layers)}[mode]
    for block in blocks:
        block.forward = functools.partial(checkpointed, block.forward)


def checkpointed(forward, *args, **kwargs):
    """`forward` (a block's) under non-reentrant activation checkpointing. A frame of our own around
    torch's checkpoint: block.compile() traces it and turns the checkpoint into dynamo's higher-order
    op, so a checkpointed block is compiled. With torch's checkpoint itself as the block's forward
    dynamo found no frame it could trace (checkpoint is marked to skip dynamo) and the block ran
    eagerly, silently, with trainer.compile=true."""
    if forward.__self__.feed_forward.collect_stats:
        # The FFN statistics stay out of graphs (srelu24_kernels/ffn_stats.py): the checkpoint of a
        # step that collects them runs eagerly. This branch makes dynamo guard on the flag, so that
        # the other steps get their own compiled checkpoint; without it that first eager fallback
        # was kept for every later step.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def shard(model: nn.Module, d: Dist, bf16_params: bool) -> None:
    """FSDP2: each block is one all-gather / reduce-scatter unit; the root holds the embedding,
    final norm and output. bf16_params (CUDA with bf16 precision): bf16 compute, fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_params else None
    kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


# ---------------------------------------------------------------- collectives used by the loop
# Every rank calls each of these at the same point of every step (or of every log step): the
# order of collectives is the same on all ranks by construction.

def agree(flags: list[bool], d: Dist) -> list[bool]:
    """Each flag true on any rank -> true on every rank (one small all-reduce)."""
    if not d.enabled or d.world_size == 1:
        return flags
    t = torch.tensor([float(f) for f in flags], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def sum_over_ranks(x: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled and d.world_size > 1:
        x = x.clone()
        dist.all_reduce(x)  # SUM: gloo has no AVG
    return x


def current() -> Dist:
    """This process's place in the process group it has joined, for code that is not handed a
    Dist (checkpoints, export): rank 0 of 1 without a group."""
    if not dist.is_initialized():
        return Dist()
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), enabled=True)


def gather_object(obj, d: Dist, group=None) -> list:
    """Every rank's obj, on every rank (a list of one without a group of several)."""
    if not d.enabled or d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, d: Dist, slow: bool = False):
    """Rank 0's value on every rank. slow: through the gloo group without a practical timeout,
    for a wait as long as rank 0's data preparation."""
    if not d.enabled or d.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=d.slow_group if slow else None)
    return box[0]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """The global gradient norm (all ranks get the same value, also from sharded gradients), and
    gradients scaled to max_norm. Same arithmetic as torch.nn.utils.clip_grad_norm_."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
