"""model.attention: causal (the default) and document (model/attention.py): FlexAttention's block
mask and the dense mask against an explicit reference, a document model against each document run
alone, causal unchanged, the KV cache of a document model, and the step on a GPU."""
import math

import pytest
import torch

from model import FFNConfig, ModelConfig, Transformer
from model.attention import attend, document_ids, document_mask
from model.generate import generate

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:srelu24. using the pure-PyTorch")]

V, EOT = 61, 0


def reference(q, k, v, doc):
    """Softmax attention written out: position i sees j <= i of its own document."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    S = q.shape[2]
    allowed = torch.ones(S, S, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


def window(B, S, eots, seed=0):
    x = torch.randint(1, V, (B, S), generator=torch.Generator().manual_seed(seed))
    for b, s in eots:
        x[b, s] = EOT
    return x


def test_document_ids_start_a_document_at_each_eot():
    x = torch.tensor([[5, 0, 7, 8, 0, 0, 3]])
    assert document_ids(x, EOT).tolist() == [[0, 1, 1, 1, 2, 3, 3]]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("S", [40, 300])  # 300: more than two of flex's 128-blocks, one partial
def test_flex_and_dense_masks_equal_the_reference(heads, S):
    H, H_kv = heads
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, S, 16, generator=g) for h in (H, H_kv, H_kv))
    # boundaries inside a block, on a block edge (128), at position 0, and a window without any
    x = window(2, S, [(0, 0), (0, 7), (0, S // 2), (0, min(128, S - 1)), (0, min(129, S - 1))])
    doc = document_ids(x, EOT)
    assert doc[0].unique().numel() >= 4 and doc[1].unique().numel() == 1
    want = reference(q, k, v, doc)
    dense, flex = document_mask(doc, flex=False), document_mask(doc, flex=True)
    assert (dense.shape, dense.dtype) == ((2, 1, S, S), torch.bool)
    gqa = H != H_kv
    torch.testing.assert_close(attend(q, k, v, dense, gqa), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend(q, k, v, flex, gqa), want, atol=1e-5, rtol=1e-5)
    # window 1 has one document: plain causal attention
    torch.testing.assert_close(attend(q, k, v, None, gqa)[1], want[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(attend(q, k, v, None, gqa)[0], want[0], atol=1e-3)


def model(attention: str, kind="swiglu", eot_id=EOT, seed=0, max_len=64) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(name="t", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, swiglu_hidden=64, max_seq_len=max_len,
                      attention=attention, init_std=0.1)
    m = Transformer(cfg, FFNConfig(kind=kind, hidden_dim=64 if kind != "swiglu" else None), V, eot_id=eot_id)
    m.set_2to4(kind == "srelu24")
    return m.eval()


@pytest.mark.parametrize("kind", ["swiglu", "srelu24"])
@torch.no_grad()
def test_document_model_sees_each_document_as_if_alone(kind):
    doc_model, causal = model("document", kind), model("causal", kind)
    causal.load_state_dict(doc_model.state_dict())
    x = window(2, 40, [(0, 10), (0, 25), (1, 0)])
    got = doc_model(x)
    for b, cuts in ((0, [0, 10, 25, 40]), (1, [0, 40])):
        for lo, hi in zip(cuts, cuts[1:]):  # RoPE is relative: the shift to position 0 changes nothing
            torch.testing.assert_close(got[b, lo:hi], causal(x[b:b + 1, lo:hi])[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[0, 10:25], causal(x[:1, :25])[0, 10:], atol=1e-3)  # the mask matters
    y = torch.randint(0, V, x.shape)
    loss = doc_model(x, y)
    assert torch.isfinite(loss)


def test_causal_is_unchanged_and_document_needs_the_eot_id():
    a, b = model("causal", eot_id=None), model("causal", eot_id=EOT)
    x = window(2, 30, [(0, 5), (1, 17)])
    with torch.no_grad():
        assert torch.equal(a(x), b(x))  # the EOT id plays no part in causal attention
    with pytest.raises(ValueError, match="needs the end-of-text token id"):
        model("document", eot_id=None)(x)


def test_document_model_trains_on_the_cpu():
    m = model("document").train()
    x = window(2, 30, [(0, 5), (1, 17)])
    m(x, torch.randint(0, V, x.shape)).backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@torch.no_grad()
def test_document_model_generates_with_the_cache_like_its_full_forward():
    """One document in the context (an EOT first, none after): the cached causal path equals the
    document-masked full forward, token by token."""
    m = model("document", seed=3)
    prompt = [EOT, 5, 9, 2, 33]
    new = generate(m, prompt, 12, temperature=0, eos_id=EOT)
    ids = prompt + new
    want = []
    for i in range(len(new)):  # greedy from the full forward of everything so far
        want.append(int(m(torch.tensor([ids[:len(prompt) + i]]))[0, -1].argmax()))
    assert new == want


@pytest.mark.gpu
def test_document_flex_attention_on_cuda_equals_the_dense_mask():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    x = window(2, 1024, [(0, 100), (0, 600), (1, 300)]).cuda()
    doc = document_ids(x, EOT)
    flex, dense = attend(q, k, v, document_mask(doc), True), attend(q, k, v, document_mask(doc, flex=False), True)
    torch.testing.assert_close(flex, dense, atol=2e-2, rtol=2e-2)
    g_flex = torch.autograd.grad(flex.float().square().sum(), (q, k, v))
    g_dense = torch.autograd.grad(dense.float().square().sum(), (q, k, v))
    for a, b in zip(g_flex, g_dense):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
