"""AdamW with weight decay on matrices only, and the learning-rate schedules."""
import math

import torch
import torch.nn as nn

from .config import OptimConfig, Schedule


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Decay 2-D weights of Linear layers; not norms and not the embedding (as in Llama and
    lingua, the embedding is a lookup table rather than a matrix in a matmul)."""
    decay, no_decay = [], []
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embedding else no_decay).append(p)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for `step` (0-based) of `total_steps`: linear warmup from lr/warmup,
    then cosine to min_lr_ratio * lr, a WSD plateau and linear decay, or constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == Schedule.constant:
        return cfg.lr
    if cfg.schedule == Schedule.wsd:
        decay_steps = max(1, int(cfg.decay_fraction * total_steps))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return cfg.lr
        return min_lr + (cfg.lr - min_lr) * (total_steps - step) / decay_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
