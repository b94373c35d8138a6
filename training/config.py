"""The config schema: one dataclass per group, registered in Hydra's ConfigStore, so a
misspelt key or a wrong type fails at start-up with Hydra's message. The YAML files in
configs/ fill these in; experiments override them."""
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from data.config import DataConfig
from model.config import FFNConfig, ModelConfig, ffn_hidden_dim
from srelu24_kernels.float8 import scaled_mm_shapes


class Schedule(str, Enum):
    cosine = "cosine"      # linear warmup, cosine decay to min_lr_ratio * lr
    wsd = "wsd"            # linear warmup, constant, linear decay over the last decay_fraction
    constant = "constant"  # linear warmup, then constant


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1   # matrices only; norms and embeddings are not decayed
    grad_clip: float = 1.0      # max global grad norm; 0 disables
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd only
    fused: Optional[bool] = None  # None: fused AdamW on CUDA


class Strategy(str, Enum):
    none = "none"  # one process; under torchrun / SLURM with several processes this is an error
    ddp = "ddp"    # DistributedDataParallel: a full replica per rank, gradients all-reduced
    fsdp = "fsdp"  # FSDP2 fully_shard: parameters, gradients and optimizer state sharded per block


class Float8(str, Enum):
    none = "none"              # bf16 (or fp32) GEMMs
    tensorwise = "tensorwise"  # torchao's recipe: one scale per tensor (training/float8.py)
    rowwise = "rowwise"        # torchao's recipe: one scale per row, power-of-2 scales, e4m3 gradients


class ActivationCheckpointing(str, Enum):
    none = "none"
    selective = "selective"  # every other block (0, 2, 4, ...) recomputed in backward
    full = "full"            # every block recomputed in backward


@dataclass
class TrainerConfig:
    seed: int = 1337
    seq_len: int = 256
    batch_size: int = 16         # global batch, in sequences
    micro_batch_size: int = 16   # per rank and forward pass; accumulation makes up the rest
    total_tokens: int = 10_000_000  # token budget: steps = total_tokens / (batch_size * seq_len)
    max_steps: int = -1          # > 0: use this many steps instead of the token budget
    stop_at_step: int = -1       # > 0: stop (with a checkpoint) at this step; the schedule is unchanged
    eval_every: int = 200
    eval_batches: int = 8        # a fixed validation subset of eval_batches * micro_batch_size windows
    log_every: int = 10
    # the FFNs' activation statistics every this many steps (a multiple of log_every); 0: every
    # logged step. Under cuda_graph a step with statistics runs eagerly, others replay the graph
    ffn_stats_every: int = 0
    ckpt_every: int = 500
    keep_last: int = 3           # checkpoints kept in the run dir (0: all); older ones are deleted after a save
    nonfinite: str = "skip"      # a non-finite loss or gradient: skip (the step, counted) | stop (with the tensor)
    resume: str = "none"         # none | auto (the latest valid checkpoint in the run dir) | a checkpoint dir
    device: str = "auto"         # auto | cpu | cuda | cuda:N
    precision: str = "auto"      # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    compile: bool = False        # torch.compile per block and of the loss head
    strategy: Strategy = Strategy.none  # none | ddp | fsdp (docs/DISTRIBUTED.md)
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none  # none | selective | full
    float8: Float8 = Float8.none  # none | tensorwise | rowwise: float8 linears via torchao (GPUs of sm89+)
    # each micro-batch's forward and backward replayed from a CUDA graph (training/cuda_graph.py):
    # for steps that wait on the host; one CUDA process, no activation checkpointing, causal attention
    cuda_graph: bool = False
    dist_timeout_s: int = 1800   # a collective that waits longer than this ends the run (a lost rank)
    dry_run: bool = False        # build on the meta device, print sizes and FLOPs, exit
    progress: bool = True
    num_threads: int = 0         # CPU threads for torch; 0 leaves torch's default
    # checkpoints written in the background (docs/RELIABILITY.md): the loop waits only for the copy
    # into host memory. None: on with CUDA, off on CPU (there the copy costs what the write does)
    async_checkpoint: Optional[bool] = None
    check_space: bool = True     # before training: stop if the checkpoints to come do not fit on the disk
    # before the data and the model: stop if the estimated peak memory does not fit the device, warn
    # close to it (training/preflight.py); the dry run prints the same verdict
    check_memory: bool = True
    # what check_memory compares with; None: the device's free memory (on the CPU the available RAM;
    # a dry run without a GPU: one H200's)
    memory_capacity_gib: Optional[float] = None
    # settings a resume may change (e.g. [trainer.max_steps, optim.lr]); others that differ from the
    # checkpoint's (model, ffn, optim, schedule length, batch, seed) stop the resume
    resume_overrides: List[str] = field(default_factory=list)


def pairs_grad_unscaling(m: ModelConfig, f: FFNConfig, t: TrainerConfig, grad_accumulation: bool) -> bool:
    """Whether ffn.paired_grad_unscaling applies to a run: srelu24's kernels with the tensorwise
    recipe's e4m3 2:4 GEMMs (shapes torch._scaled_mm takes), gradient accumulation, and one process
    (not DDP or FSDP2; trainer.cuda_graph captures one graph per half of a pair). model/ffn.py's
    begin_step decides the same at run time, on an sm90 GPU."""
    return (f.kind == "srelu24" and f.paired_grad_unscaling and f.kernels and f.sparse_float8
            and t.float8 == Float8.tensorwise and scaled_mm_shapes(m.dim, ffn_hidden_dim(m, f))
            and grad_accumulation and t.strategy == Strategy.none)


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # wandb's older names, which it still accepts


def wandb_mode_from_env(default: str) -> str:
    """configs/logging/default.yaml's ${wandb_mode:offline}: the WANDB_MODE environment variable
    where it is set (the cluster convention), else `default`; logging.wandb.mode=... overrides both."""
    value = os.environ.get("WANDB_MODE", "")
    if not value:
        return default
    mode = WANDB_MODE_ALIASES.get(value, value)
    if mode not in WandbMode.__members__:
        raise ValueError(f"WANDB_MODE={value} in the environment: valid values are online, offline, disabled "
                         f"(wandb's dryrun and run mean offline and online), or set logging.wandb.mode")
    return mode


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline  # configs/logging/default.yaml: WANDB_MODE where it is set
    project: str = "srelu24"
    entity: Optional[str] = None
    group: Optional[str] = None   # None: the experiment's name
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # on GPUs: the median SM clock and power of each log interval (NVML every 0.5 s, training/gpu_clocks.py;
    # the speed of a power-capped GPU follows them). Off, or where NVML cannot be read: not logged.
    gpu_clocks: bool = True


@dataclass
class Config:
    name: str = "default"  # the experiment's name: wandb group, run directory
    model: ModelConfig = field(default_factory=ModelConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_configs() -> None:
    """configs/config.yaml lists `schema` first, so every group's YAML merges into a typed node."""
    ConfigStore.instance().store(name="schema", node=Config)
    OmegaConf.register_new_resolver("wandb_mode", wandb_mode_from_env, replace=True)
