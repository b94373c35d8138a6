"""Parameter and FLOP counts: the one definition used by the dry run, MFU and the reports."""
from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class ModelSize:
    total: int          # every parameter, counted once (tied weights once)
    embedding: int      # token embedding
    output: int         # LM head (0 when tied to the embedding)
    non_embedding: int  # total - embedding - output
    matmul: int         # weights used in matmuls: every Linear, LM head included
    n_layers: int
    dim: int
    seq_len: int

    @property
    def attention_flops_per_token(self) -> int:
        """Training FLOPs of QK^T and AV per token: 12 * L * d * S (PaLM, appendix B).
        Causality is not discounted, as is the convention for MFU."""
        return 12 * self.n_layers * self.dim * self.seq_len

    @property
    def flops_per_token(self) -> int:
        """Dense-equivalent training FLOPs per token (forward + backward): 6 N + 12 L d S.
        srelu24 is counted as dense, so its speed-up shows as a higher MFU."""
        return 6 * self.matmul + self.attention_flops_per_token

    @property
    def forward_flops_per_token(self) -> int:
        return self.flops_per_token // 3


def model_size(model: nn.Module, seq_len: int) -> ModelSize:
    """Counts from the module itself, so it works on the meta device."""
    seen, total, matmul = set(), 0, 0
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if isinstance(m, nn.Linear):
                matmul += p.numel()
    embedding = model.tok_embeddings.weight.numel()
    tied = model.output.weight is model.tok_embeddings.weight
    output = 0 if tied else model.output.weight.numel()
    if tied:
        matmul += embedding  # the tied LM head is still a matmul
    return ModelSize(total=total, embedding=embedding, output=output,
                     non_embedding=total - embedding - output, matmul=matmul,
                     n_layers=model.cfg.n_layers, dim=model.cfg.dim, seq_len=seq_len)
