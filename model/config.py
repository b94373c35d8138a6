"""Schemas of the `model` and `ffn` config groups (see configs/model, configs/ffn)."""
from dataclasses import dataclass
from typing import Optional

from .attention import AttentionKind
from .ffn import check_ffn_kind, ffn_class


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
    attention: AttentionKind = AttentionKind.causal  # document: no attention across end-of-text tokens


def attention_shape_problem(cfg: ModelConfig) -> Optional[str]:
    """What makes the attention's shapes impossible, in one line naming the settings; None if nothing.
    One definition for the model (ValueError) and the trainer's start-up checks (exit 2)."""
    if cfg.n_heads <= 0 or cfg.dim % cfg.n_heads:
        return f"model.dim={cfg.dim} must be divisible by model.n_heads={cfg.n_heads}"
    if (cfg.dim // cfg.n_heads) % 2:
        return f"the head size model.dim/model.n_heads={cfg.dim // cfg.n_heads} must be even for RoPE"
    if cfg.n_kv_heads is not None and (cfg.n_kv_heads <= 0 or cfg.n_heads % cfg.n_kv_heads):
        return f"model.n_kv_heads={cfg.n_kv_heads} must divide model.n_heads={cfg.n_heads}"
    return None


@dataclass
class FFNConfig:
    kind: str = "swiglu"              # a registered FFN (model/ffn.py): swiglu, srelu, srelu24
    hidden_dim: Optional[int] = None  # None: the variant's default_hidden (swiglu_hidden; 1.5x for srelu*)
    # The srelu24 recipe; the dense variants ignore these.
    dense_warmup_steps: int = 1000       # plain srelu for this many steps, then 2:4
    token_permutation: bool = True       # permute tokens before the token-dim 2:4 of the weight grads
    dense_feature_fraction: float = 0.05  # densest features kept dense in the weight grads
    reuse_forward_mask: bool = True      # backward re-applies the forward 2:4 mask to dZ
    kernels: bool = True                 # fused GPU kernels + cuSPARSELt where they run (sm80/sm90)
    sparse_float8: bool = True           # with trainer.float8 set, the four 2:4 GEMMs in e4m3 too (false: bf16)
    # cuSPARSELt's algorithm id for every 2:4 GEMM; null: timed per shape at its first use (so two
    # runs may choose differently; the choice is logged)
    sparse_gemm_alg: Optional[int] = None
    # under gradient accumulation in one process (tensorwise, e4m3 2:4 GEMMs, sm90): dW1 and dW2 unscaled two
    # micro-batches a pass, the same bits, keeping one micro-batch's products (2 bytes an element of W1 and W2)
    paired_grad_unscaling: bool = True

    def __post_init__(self):  # also where Hydra's config becomes objects: an unknown kind fails at start-up
        check_ffn_kind(self.kind)


def ffn_hidden_dim(model: ModelConfig, ffn: FFNConfig) -> int:
    """The FFN hidden size: ffn.hidden_dim, or the variant's default for the model
    (`default_hidden` of its class in model/ffn.py)."""
    if ffn.hidden_dim is not None:
        return ffn.hidden_dim
    return ffn_class(ffn.kind).default_hidden(model.swiglu_hidden)
