"""Plain PyTorch model code: no I/O, no logging."""
from .config import FFNConfig, ModelConfig, ffn_hidden_dim
from .ffn import FFN_REGISTRY, register_ffn
from .flops import ModelSize, model_size
from .transformer import Transformer

__all__ = ["FFNConfig", "FFN_REGISTRY", "register_ffn", "ModelConfig", "ffn_hidden_dim", "ModelSize", "model_size",
           "Transformer"]
