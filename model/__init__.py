"""Plain PyTorch model code: no I/O, no logging."""
from .config import FFNConfig, FFNKind, ModelConfig, ffn_hidden_dim
from .flops import ModelSize, model_size
from .transformer import Transformer

__all__ = ["FFNConfig", "FFNKind", "ModelConfig", "ffn_hidden_dim", "ModelSize", "model_size", "Transformer"]
