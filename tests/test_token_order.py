"""srelu24's token permutation done by the block (the norm before the FFN reads rows in a random
order, the residual add writes them back) instead of inside the FFN's backward: the same
function and the same gradients."""
import pytest
import torch

import srelu24_kernels.srelu24.reference as ref
from srelu24_kernels.srelu24.reference import permute_rows, random_token_orders
from model import FFNConfig, ModelConfig, Transformer
from model.transformer import Block, rope_tables

CFG = ModelConfig(dim=32, n_layers=2, n_heads=2, swiglu_hidden=64, max_seq_len=16)


def test_random_token_orders_are_permutations_with_their_inverses():
    torch.manual_seed(0)
    o = random_token_orders(100, 3, "cpu")
    assert o.shape == (3, 2, 100) and o.dtype == torch.int32
    for order, inverse in o:
        assert torch.equal(order.sort().values, torch.arange(100, dtype=torch.int32))
        assert torch.equal(order[inverse.long()], torch.arange(100, dtype=torch.int32))
    assert not torch.equal(o[0, 0], o[1, 0])  # one draw per layer


def test_permute_rows_gathers_both_ways():
    torch.manual_seed(1)
    order, inverse = random_token_orders(12, 1, "cpu")[0]
    x = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    y = permute_rows(x, order, inverse)
    assert torch.equal(y, x.detach()[order.long()])
    g = torch.randn(12, 5, dtype=torch.float64)
    y.backward(g)
    assert torch.equal(x.grad, g[inverse.long()])  # a gather, not an accumulating scatter
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, order, inverse), (x.detach().requires_grad_(),))


def block_grads(block, x, cos, sin, token_order=None):
    for p in block.parameters():
        p.grad = None
    xx = x.clone().requires_grad_()
    y = block(xx, cos, sin, token_order=token_order)
    torch.manual_seed(3)
    y.backward(torch.randn_like(y))
    return y.detach(), xx.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def test_block_permutation_equals_the_ffns_own(monkeypatch):
    """With the same order: the FFN permuting in its backward (the old path) and the block
    permuting around it give the same output and gradients (float64; the norm weight's gradient
    sums its rows in another order)."""
    torch.manual_seed(2)
    block = Block(CFG, FFNConfig(kind="srelu24")).double()
    block.feed_forward.set_2to4(True)
    B, S = 2, 16
    cos, sin = (t.double() for t in rope_tables(CFG.dim // CFG.n_heads, S, CFG.rope_theta))
    x = torch.randn(B, S, CFG.dim, dtype=torch.float64)
    order, inverse = random_token_orders(B * S, 1, "cpu")[0]
    monkeypatch.setattr(ref, "random_token_order", lambda T, device: order)  # the FFN's own draw
    old = block_grads(block, x, cos, sin)
    monkeypatch.setattr(ref, "random_token_order", lambda T, device: pytest.fail("the FFN drew its own order"))
    new = block_grads(block, x, cos, sin, token_order=torch.stack([order, inverse]))
    torch.testing.assert_close(new[0], old[0], rtol=0, atol=0)  # the forward: row by row, exactly
    torch.testing.assert_close(new[1], old[1], rtol=1e-12, atol=1e-12)
    for name in old[2]:
        torch.testing.assert_close(new[2][name], old[2][name], rtol=1e-12, atol=1e-12, msg=name)
    # and the order matters to the weight gradients (it is not silently ignored)
    other = random_token_orders(B * S, 1, "cpu")[0]
    third = block_grads(block, x, cos, sin, token_order=other)
    assert not torch.allclose(third[2]["feed_forward.w1.weight"], old[2]["feed_forward.w1.weight"])


def test_the_model_draws_orders_only_for_2to4_training(monkeypatch):
    torch.manual_seed(4)
    model = Transformer(CFG, FFNConfig(kind="srelu24"), 64)
    tokens = torch.randint(0, 64, (2, 16))
    assert model.token_orders(32, "cpu") is None  # dense warmup: nothing to permute
    model.set_2to4(True)
    orders = model.token_orders(32, "cpu")
    assert len(orders) == CFG.n_layers and all(o.shape == (2, 32) for o in orders)
    with torch.no_grad():
        assert model.token_orders(32, "cpu") is None  # evaluation: the forward does not depend on it
        unpermuted = Transformer(CFG, FFNConfig(kind="srelu24", token_permutation=False), 64)
        unpermuted.load_state_dict(model.state_dict())
        unpermuted.set_2to4(True)
        want = unpermuted(tokens, tokens)
    monkeypatch.setattr(ref, "random_token_order", lambda T, device: pytest.fail("the FFN drew its own order"))
    loss = model(tokens, tokens)
    torch.testing.assert_close(loss.detach(), want, rtol=1e-6, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
