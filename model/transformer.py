"""A Llama-style decoder: pre-RMSNorm, RoPE, causal SDPA attention (GQA optional), no biases,
untied embeddings by default. With ffn=swiglu it is numerically Llama: every weight maps 1:1
onto Hugging Face's LlamaForCausalLM (see HF_NAMES).

Initialisation (`Transformer.reset_parameters`):
- every Linear and the token embedding: normal(0, init_std), init_std = 0.02 by default;
- the projections that write into the residual stream (attention `wo`; the FFN's
  `residual_projections()`, `w2` for all three variants):
  normal(0, init_std / sqrt(2 * n_layers)), so the residual's variance does not grow with
  depth (GPT-2, torchtitan);
- RMSNorm weights: 1.
The same rule holds for all three FFN variants, so they start from comparable scales.

Attention is causal over the window, or with model.attention=document causal within each document
of it (model/attention.py; the model then needs the end-of-text id: `Transformer(..., eot_id=)`).

Inference: `forward(tokens, cache=..., start_pos=p)` with a `KVCache` (`model.new_cache()`)
runs tokens at positions p..p+S-1, writes their keys/values into the cache and attends to
everything cached before them (model/generate.py samples with it). Without a cache the
forward is the training path, unchanged. With a cache attention is causal over the cache, also
for a document model: the same as its training forward while the context holds no EOT after
its first token (sample.py's prompts are one document, and generation stops at EOT).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from srelu24_kernels.srelu24.reference import permute_rows, random_token_orders

from .attention import AttentionKind, Mask, attend, document_ids, document_mask
from .config import FFNConfig, ModelConfig, attention_shape_problem, ffn_hidden_dim
from .ffn import build_ffn


class RMSNorm(nn.Module):
    """As in HF Llama: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # HF's "rotate_half" layout
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, S, hd]; cos/sin: [S, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


@dataclass
class KVCache:
    """Keys and values of every layer, preallocated: k[i], v[i] are [B, n_kv_heads, max_len,
    head_dim] (post-RoPE keys). Which positions are filled is the caller's `start_pos`."""
    k: list[Tensor]
    v: list[Tensor]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                kv: Optional[tuple[Tensor, Tensor]] = None, start_pos: int = 0, mask: Mask = None) -> Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if kv is None:  # training: the whole sequence at once
            out = attend(q, k, v, mask, gqa)
        else:
            out = self._cached(q, k, v, kv, start_pos, gqa)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))

    @staticmethod
    def _cached(q: Tensor, k: Tensor, v: Tensor, kv: tuple[Tensor, Tensor], start_pos: int, gqa: bool) -> Tensor:
        """Store k, v at start_pos.. in the cache, then attend to cache positions 0..end-1."""
        S, end = q.shape[2], start_pos + q.shape[2]
        cache_k, cache_v = kv
        cache_k[:, :, start_pos:end] = k
        cache_v[:, :, start_pos:end] = v
        k, v = cache_k[:, :, :end], cache_v[:, :, :end]
        if start_pos == 0:  # prefill: plain causal attention
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        mask = None  # one new token sees every cached position
        if S > 1:    # a chunk after an offset: query i sees positions 0..start_pos+i
            mask = torch.ones(S, end, dtype=torch.bool, device=q.device).tril(diagonal=start_pos)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn: FFNConfig, float8: str = "none"):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = build_ffn(ffn, cfg.dim, ffn_hidden_dim(cfg, ffn), float8)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                kv: Optional[tuple[Tensor, Tensor]] = None, start_pos: int = 0,
                token_order: Optional[Tensor] = None, mask: Mask = None) -> Tensor:
        """token_order [2, B*S] (an order and its inverse): the FFN sees its tokens in that order.
        The FFN acts on each token alone, so this is exact; the norm reads its rows in that
        order and the residual add writes them back in token order (both gathers fuse there)."""
        if self.feed_forward.collect_stats:
            # The dense FFNs' statistics run outside graphs (srelu24_kernels/ffn_stats.py) and split a
            # compiled block there. Branching here makes dynamo guard on the flag before that split, so
            # the other steps keep the block as one graph; without it, the first statistics step's
            # split block served every later step.
            return self._forward(x, cos, sin, kv, start_pos, token_order, mask)
        return self._forward(x, cos, sin, kv, start_pos, token_order, mask)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Optional[tuple[Tensor, Tensor]], start_pos: int,
                 token_order: Optional[Tensor], mask: Mask) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, start_pos, mask)
        if token_order is None:
            return x + self.feed_forward(self.ffn_norm(x))
        order, inverse = token_order[0], token_order[1]
        rows = permute_rows(x.reshape(-1, x.shape[-1]), order, inverse)
        y = self.feed_forward(self.ffn_norm(rows), tokens_permuted=True)
        return x + permute_rows(y, inverse, order).view_as(x)


def _init(p: Tensor, fill) -> None:
    """Fill the whole tensor on the default device (the CPU, so its RNG; nothing under a meta
    device context), then keep this process's part of it: the same seed gives the same weights
    on any device, sharded (an FSDP DTensor) or not."""
    full = fill(torch.empty(p.shape, dtype=p.dtype))
    if isinstance(p, DTensor):
        full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    p.copy_(full)


class Transformer(nn.Module):
    """float8: the trainer's float8 recipe (trainer.float8), which srelu24's own GEMMs take; the
    linears themselves are converted by training/float8.py."""

    def __init__(self, cfg: ModelConfig, ffn: FFNConfig, vocab_size: int, eot_id: Optional[int] = None,
                 float8: str = "none"):
        super().__init__()
        problem = attention_shape_problem(cfg)
        if problem:
            raise ValueError(problem)
        self.cfg, self.ffn_cfg, self.vocab_size = cfg, ffn, vocab_size
        self.documents = AttentionKind(cfg.attention) == AttentionKind.document
        self.eot_id = eot_id  # where documents end (model.attention=document)
        self.tok_embeddings = nn.Embedding(vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, ffn, float8) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.dim // cfg.n_heads), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.dim // cfg.n_heads), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight, and the RoPE tables (buffers that checkpoints do not hold),
        so a model built on the meta device and materialised with to_empty() is complete."""
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for layer in self.layers:  # to_empty() leaves the statistics buffers uninitialised too
            layer.feed_forward.stats.zero_()
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        residual = {id(layer.attention.wo.weight) for layer in self.layers}
        residual |= {id(w) for layer in self.layers for w in layer.feed_forward.residual_projections()}
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                _init(p, nn.init.ones_)
            elif id(p) in residual:
                _init(p, lambda t: nn.init.normal_(t, 0.0, residual_std))
            else:
                _init(p, lambda t: nn.init.normal_(t, 0.0, std))

    def token_orders(self, T: int, device) -> Optional[list]:
        """One random token order per layer whose FFN wants one (srelu24's 2:4 phase), drawn at
        once; None when no FFN does, or without gradients (the forward does not depend on it)."""
        wants = [layer.feed_forward.wants_token_order() for layer in self.layers]
        if not any(wants) or not torch.is_grad_enabled():
            return None
        drawn = iter(random_token_orders(T, sum(wants), device))
        return [next(drawn) if w else None for w in wants]

    def set_2to4(self, active: bool) -> None:
        """Switch the srelu24 FFNs between the dense warmup and 2:4 (no-op for other FFNs)."""
        for layer in self.layers:
            layer.feed_forward.set_2to4(active)

    def collect_ffn_stats(self, enabled: bool) -> None:
        """Have every FFN add activation statistics to its device buffer (srelu24_kernels/ffn_stats.py)."""
        for layer in self.layers:
            layer.feed_forward.collect_stats = enabled

    def pop_ffn_stats(self) -> Tensor:
        """The per-layer sums [n_layers, N_SUMS] (still on the device), and reset them."""
        sums = torch.stack([layer.feed_forward.stats.clone() for layer in self.layers])
        for layer in self.layers:
            layer.feed_forward.stats.zero_()
        return sums

    def new_cache(self, batch_size: int = 1, max_len: Optional[int] = None, device=None, dtype=None) -> KVCache:
        """An empty KVCache for `max_len` positions (default model.max_seq_len), on the
        model's device and in its dtype unless given."""
        max_len = max_len or self.cfg.max_seq_len
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        w = self.tok_embeddings.weight
        attn = self.layers[0].attention
        shape = (batch_size, attn.n_kv_heads, max_len, attn.head_dim)
        kw = dict(device=device or w.device, dtype=dtype or w.dtype)
        n = len(self.layers)
        return KVCache(k=[torch.zeros(shape, **kw) for _ in range(n)], v=[torch.zeros(shape, **kw) for _ in range(n)])

    def forward(self, tokens: Tensor, targets: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, start_pos: int = 0) -> Tensor:
        """Logits [B, S, V], or the mean cross-entropy when targets are given. With a `cache`,
        `tokens` are positions start_pos..start_pos+S-1 of sequences whose earlier positions
        are already in the cache (see KVCache)."""
        S = tokens.shape[1]
        end = start_pos + S
        if end > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if cache is None and start_pos:
            raise ValueError("start_pos needs a cache holding the earlier positions")
        if cache is not None and end > cache.max_len:
            raise ValueError(f"positions up to {end} do not fit the cache of length {cache.max_len}")
        cos, sin = self.rope_cos[start_pos:end], self.rope_sin[start_pos:end]
        mask = None
        if self.documents and cache is None:  # one mask per forward, shared by the layers
            if self.eot_id is None:
                raise ValueError("model.attention=document needs the end-of-text token id: Transformer(..., eot_id=)")
            mask = document_mask(document_ids(tokens, self.eot_id))
        h = self.tok_embeddings(tokens)
        orders = self.token_orders(tokens.numel(), tokens.device) if cache is None else None
        for i, layer in enumerate(self.layers):
            if cache is not None:
                h = layer(h, cos, sin, (cache.k[i], cache.v[i]), start_pos)
            else:
                h = layer(h, cos, sin, token_order=orders[i] if orders else None, mask=mask)
        if targets is None:
            return self.output(self.norm(h))
        return self.loss(h, targets)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Final norm, output projection and mean cross-entropy (fp32 softmax). One method so that
        trainer.compile can compile it whole: then the fp32 logits [tokens, vocab] are never
        written out."""
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# Our parameter names -> Hugging Face LlamaForCausalLM's ({i}: layer index).
HF_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
