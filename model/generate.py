"""Autoregressive sampling with the KV cache: the prompt runs once (prefill), then one token
per step, each attending to the cached keys and values of everything before it."""
from typing import Optional, Sequence

import torch
from torch import Tensor

from .transformer import Transformer


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> int:
    """One token id from the logits [V] of the last position. temperature 0: greedy (argmax);
    otherwise softmax(logits / temperature) over the top_k largest (all when None). Sampling
    runs on the CPU, so a CPU `generator` reproduces it whatever the model's device."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, eos_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None) -> list[int]:
    """The new token ids after `prompt_ids` (not repeating the prompt), in eval mode.

    Stops after `max_new_tokens`, after `eos_id` (which is included as the last id), or when
    the context is full: the model sees at most model.cfg.max_seq_len tokens, so at most
    max_seq_len + 1 - len(prompt_ids) tokens come back (callers can tell from the length).
    A prompt longer than max_seq_len is a ValueError.
    """
    max_len = model.cfg.max_seq_len
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("the prompt is empty: generation needs at least one token to start from")
    if len(ids) > max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is model.max_seq_len={max_len}")
    if not all(0 <= t < model.vocab_size for t in ids):
        raise ValueError(f"prompt token ids must lie in [0, {model.vocab_size}) (the model's vocabulary)")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    n_new = min(max_new_tokens, max_len + 1 - len(ids))
    if n_new <= 0:
        return []

    was_training = model.training
    model.eval()
    try:
        device = model.tok_embeddings.weight.device
        # the last new token is never fed back, so the cache needs len(ids) + n_new - 1 positions
        cache = model.new_cache(batch_size=1, max_len=len(ids) + n_new - 1)
        logits = model(torch.tensor([ids], device=device), cache=cache)[0, -1]
        out: list[int] = []
        for i in range(n_new):
            token = sample_next(logits, temperature, top_k, generator)
            out.append(token)
            if token == eos_id or i == n_new - 1:
                break
            pos = len(ids) + i
            logits = model(torch.tensor([[token]], device=device), cache=cache, start_pos=pos)[0, -1]
        return out
    finally:
        model.train(was_training)
