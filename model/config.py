"""Schemas of the `model` and `ffn` config groups (see configs/model, configs/ffn)."""
from dataclasses import dataclass
from enum import Enum
from typing import Optional


class FFNKind(str, Enum):
    swiglu = "swiglu"    # W2 (silu(W1 x) * W3 x), Llama's FFN
    srelu = "srelu"      # W2 relu(W1 x)^2, hidden 1.5x SwiGLU's to match parameters and FLOPs
    srelu24 = "srelu24"  # srelu with the 2:4 activation sparsity recipe


@dataclass
class ModelConfig:
    name: str = "tiny"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: n_heads (MHA); fewer heads: GQA
    swiglu_hidden: int = 512          # SwiGLU's hidden size; the srelu variants derive theirs from it
    vocab_size: Optional[int] = None  # None: the tokenizer's vocabulary; larger pads it
    max_seq_len: int = 4096           # length of the RoPE table
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass
class FFNConfig:
    kind: FFNKind = FFNKind.swiglu
    hidden_dim: Optional[int] = None  # None: swiglu_hidden for swiglu, 1.5x rounded to 128 for srelu*
    # The srelu24 recipe; the dense variants ignore these.
    dense_warmup_steps: int = 1000       # plain srelu for this many steps, then 2:4
    token_permutation: bool = True       # permute tokens before the token-dim 2:4 of the weight grads
    dense_feature_fraction: float = 0.05  # densest features kept dense in the weight grads
    reuse_forward_mask: bool = True      # backward re-applies the forward 2:4 mask to dZ
    kernels: bool = True                 # fused GPU kernels + cuSPARSELt where they run (sm80/sm90)


SRELU_HIDDEN_MULTIPLE = 128
# The sm90 sparse GEMM layout wants the 2:4 (reduction) dimension a multiple of 32 and
# the rows of the transposed operand (features) a multiple of 64.
SPARSE24_HIDDEN_MULTIPLE = 64


def ffn_hidden_dim(model: ModelConfig, ffn: FFNConfig) -> int:
    """The FFN hidden size. srelu gets 1.5x SwiGLU's (2 matrices instead of 3: same
    parameters and FLOPs), rounded to the nearest multiple of 128."""
    if ffn.hidden_dim is not None:
        return ffn.hidden_dim
    if ffn.kind == FFNKind.swiglu:
        return model.swiglu_hidden
    m = SRELU_HIDDEN_MULTIPLE
    return max(m, (3 * model.swiglu_hidden // 2 + m // 2) // m * m)
