"""Attention masks. `model.attention=causal` (the default): each position sees every earlier
position of the window. `document`: only those of its own document, where documents are split at
the end-of-text token (data/tokenizer.py's EOT, appended after every document), so that packed
windows do not attend across unrelated documents.

An EOT opens the document after it (as a BOS would): the last token of a document still predicts
EOT from its own document, and the token after an EOT is predicted from the EOT alone, the way
generation from an empty prompt starts (scripts/sample.py).

On CUDA the document mask is a FlexAttention BlockMask built once per forward from the batch's
EOT positions, and attention runs through compiled `flex_attention` (blocks with no visible
key are skipped). On the CPU flex_attention has no backward, so the same mask is a dense
[B, 1, S, S] boolean mask for SDPA; `document_mask(..., flex=True)` builds the BlockMask there too
(forward only), which is how the two are tested against each other.
"""
from enum import Enum
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


class AttentionKind(str, Enum):
    causal = "causal"
    document = "document"


Mask = Union[None, Tensor, BlockMask]  # None: causal


def document_ids(tokens: Tensor, eot_id: int) -> Tensor:
    """[B, S] -> the document index of each position within its window (an EOT starts a new one)."""
    return (tokens == eot_id).cumsum(-1, dtype=torch.int32)


def document_mask(doc: Tensor, flex: Optional[bool] = None) -> Mask:
    """Causal within each document. flex (default: on CUDA): a BlockMask for flex_attention,
    else a dense boolean [B, 1, S, S] mask (True: attend)."""
    if flex is None:
        flex = doc.is_cuda
    B, S = doc.shape
    if not flex:
        causal = torch.ones(S, S, dtype=torch.bool, device=doc.device).tril()
        return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    return create_block_mask(same_document_causal, B, None, S, S, device=doc.device, _compile=doc.is_cuda)


_compiled_flex = None


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, gqa: bool) -> Tensor:
    """Compiled on CUDA (eager flex_attention materialises the whole score matrix); eager on the CPU."""
    global _compiled_flex
    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=gqa)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask, gqa: bool) -> Tensor:
    """Attention of q [B, H, S, hd] over k, v [B, H_kv, S, hd] under `mask` (None: causal)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, BlockMask):
        return _flex(q, k, v, mask, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
