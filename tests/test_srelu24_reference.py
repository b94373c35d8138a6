"""Tests of the 2:4 activation-sparsity reference (srelu24_kernels/srelu24/reference.py) and of the srelu24 FFN
module built on it. The backward is checked against a manual computation of the recipe in
docs/METHOD.md, The recipe: forward mask re-applied to dZ, weight gradients 2:4 along tokens
after a token permutation, the densest features kept dense."""
import math

import pytest
import torch
import torch.nn.functional as F

import model.ffn as ffn_mod
from model import FFNConfig, ModelConfig, Transformer
from model.ffn import SReLU, SReLU24
from srelu24_kernels.srelu24.options import OpOptions
from srelu24_kernels.srelu24.reference import SReLU24Recipe, densest_features, mask_2to4, sparsify_tokens_2to4, srelu24_ffn

pytestmark = pytest.mark.filterwarnings("ignore:srelu24. using the pure-PyTorch")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=gen(seed), dtype=dtype)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ref_mask_2to4(x, dim=-1):
    """Brute force: in each group of 4 along `dim`, keep the 2 largest |x|, ties to the lower index."""
    xm = x.movedim(dim, -1)
    flat = xm.reshape(-1, 4).tolist()
    keep = []
    for grp in flat:
        order = sorted(range(4), key=lambda i: (-abs(grp[i]), i))
        keep.append([i in order[:2] for i in range(4)])
    return torch.tensor(keep, dtype=torch.bool).reshape(xm.shape).movedim(-1, dim)


def ref_token_sparsify(t, dense=None):
    """2:4 along dim 0 per column (zero-padding a partial last group), dense columns untouched."""
    T = t.shape[0]
    pad = (-T) % 4
    tp = torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t
    out = (tp * ref_mask_2to4(tp, dim=0))[:T]
    if dense is not None:
        out[:, dense] = t[:, dense]
    return out


def ref_densest(a, fraction):
    k = int(round(fraction * a.shape[1]))
    counts = (a != 0).sum(0).tolist()
    return sorted(range(a.shape[1]), key=lambda j: (-counts[j], j))[:k]


def groups_of_4(t, dim):
    """View with the groups of 4 along `dim` as the last axis."""
    t = t.movedim(dim, -1)
    return t.reshape(*t.shape[:-1], -1, 4)


# ---------------------------------------------------------------- mask_2to4


@pytest.mark.parametrize("shape,dim", [((8,), -1), ((3, 16), -1), ((2, 3, 8), -1), ((5, 12), 1),
                                       ((8, 3), 0), ((12, 5, 2), 0), ((3, 8, 2), 1), ((4, 4), 0)])
def test_mask_keeps_exactly_the_two_largest_magnitudes(shape, dim):
    x = randn(*shape, seed=sum(shape) + dim, dtype=torch.float32)
    assert (x < 0).any()  # magnitude, not value, must decide
    m = mask_2to4(x, dim=dim)
    assert m.dtype == torch.bool and m.shape == x.shape
    assert (groups_of_4(m, dim).sum(-1) == 2).all()
    assert torch.equal(m, ref_mask_2to4(x, dim))
    # every kept |value| >= every dropped |value| within its group
    ga, gm = groups_of_4(x.abs(), dim), groups_of_4(m, dim)
    kept_min = torch.where(gm, ga, torch.full_like(ga, math.inf)).amin(-1)
    drop_max = torch.where(~gm, ga, torch.full_like(ga, -math.inf)).amax(-1)
    assert (kept_min >= drop_max).all()


def test_mask_uses_magnitude_for_negative_values():
    x = torch.tensor([[-5.0, 1.0, 2.0, -0.5], [0.1, -0.2, -3.0, 0.3]])
    assert mask_2to4(x).tolist() == [[True, False, True, False], [False, False, True, True]]


@pytest.mark.parametrize("group,kept", [
    ([1.0, 1.0, 1.0, 1.0], [0, 1]),
    ([0.0, 2.0, 2.0, 2.0], [1, 2]),
    ([3.0, 1.0, -3.0, 3.0], [0, 2]),
    ([0.5, 0.7, 0.7, -0.7], [1, 2]),
    ([0.0, 0.0, 0.0, 0.0], [0, 1]),
])
def test_mask_ties_go_to_the_lower_index(group, kept):
    expected = [i in kept for i in range(4)]
    assert mask_2to4(torch.tensor(group)).tolist() == expected
    # the same along dim 0, in every column
    col = torch.tensor(group).unsqueeze(1).expand(4, 3)
    assert mask_2to4(col, dim=0).tolist() == [[e] * 3 for e in expected]


def test_mask_exhaustive_small_integer_groups():
    # every group over {-2, ..., 2}^4: all tie patterns, at every pair of positions
    vals = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
    groups = torch.cartesian_prod(vals, vals, vals, vals)  # [625, 4]
    assert torch.equal(mask_2to4(groups), ref_mask_2to4(groups))
    assert torch.equal(mask_2to4(groups.t().contiguous(), dim=0), ref_mask_2to4(groups).t())


def test_mask_rejects_size_not_divisible_by_4():
    with pytest.raises(ValueError):
        mask_2to4(randn(3, 6, seed=0))
    with pytest.raises(ValueError):
        mask_2to4(randn(6, 8, seed=0), dim=0)
    mask_2to4(randn(6, 8, seed=0), dim=1)  # fine along the other dim


# ---------------------------------------------------------------- sparsify_tokens_2to4


def test_sparsify_tokens_is_2to4_along_tokens_per_column():
    t = randn(16, 12, seed=1)
    t0 = t.clone()
    out = sparsify_tokens_2to4(t, None)
    assert torch.equal(t, t0)  # input untouched
    assert out.shape == t.shape
    assert ((groups_of_4(out, 0) != 0).sum(-1) == 2).all()
    assert torch.equal(out, ref_token_sparsify(t))
    kept = out != 0
    assert torch.equal(out[kept], t[kept])


def test_sparsify_tokens_keeps_dense_features():
    t = randn(16, 12, seed=2)
    dense = torch.tensor([1, 5, 6])
    out = sparsify_tokens_2to4(t, dense)
    assert torch.equal(out[:, dense], t[:, dense])
    other = [j for j in range(12) if j not in dense.tolist()]
    assert ((groups_of_4(out[:, other], 0) != 0).sum(-1) == 2).all()
    assert torch.equal(out, ref_token_sparsify(t, dense))
    # an empty index tensor means no dense features
    assert torch.equal(sparsify_tokens_2to4(t, torch.tensor([], dtype=torch.long)), ref_token_sparsify(t))


@pytest.mark.parametrize("T", [10, 9, 7, 1])
def test_sparsify_tokens_partial_last_group(T):
    t = randn(T, 6, seed=T)
    out = sparsify_tokens_2to4(t, torch.tensor([2]))
    assert out.shape == t.shape
    assert torch.equal(out, ref_token_sparsify(t, [2]))
    full = T // 4 * 4
    cols = [0, 1, 3, 4, 5]  # all but the dense feature
    assert ((groups_of_4(out[:full, cols], 0) != 0).sum(-1) == 2).all()
    rest = T - full
    if rest <= 2:  # a last group of <= 2 real tokens (padded with zeros) keeps them all
        assert torch.equal(out[full:], t[full:])
    else:
        assert torch.equal(out[full:, 2], t[full:, 2])  # the dense feature keeps all 3
        assert ((out[full:, cols] != 0).sum(0) == 2).all()


# ---------------------------------------------------------------- densest_features


def test_densest_features_picks_most_nonzeros():
    T, Fd = 16, 10
    counts = [3, 10, 1, 16, 7, 0, 12, 5, 9, 2]
    a = torch.zeros(T, Fd, dtype=torch.float64)
    vals = randn(T, Fd, seed=3).abs() + 0.1
    for j, c in enumerate(counts):
        rows = torch.randperm(T, generator=gen(j))[:c]
        a[rows, j] = vals[rows, j]
    assert ((a != 0).sum(0).tolist()) == counts
    d = densest_features(a, 0.3)  # k = 3
    assert d.tolist() == [3, 6, 1]
    assert densest_features(a, 0.2).tolist() == [3, 6]
    assert densest_features(a, 0.0) is None
    assert densest_features(a, 0.04) is None  # round(0.4) = 0


@pytest.mark.parametrize("fraction,F_", [(0.05, 64), (0.05, 20), (0.3, 10), (0.25, 64), (0.1, 128)])
def test_densest_features_count_is_round_fraction_times_F(fraction, F_):
    a = F.relu(randn(32, F_, seed=F_))
    d = densest_features(a, fraction)
    k = int(round(fraction * F_))
    assert d is not None and d.numel() == k
    assert d.tolist() == ref_densest(a, fraction)


# ---------------------------------------------------------------- srelu24_ffn forward


def _ref_forward(x, w1, w2):
    z = x @ w1.t()
    a = F.relu(z).square()
    m = ref_mask_2to4(a)
    return z, a, m, (a * m) @ w2.t()


def test_forward_equals_masked_srelu():
    T, d, Fd = 24, 16, 32
    x, w1, w2 = randn(T, d, seed=10), randn(Fd, d, seed=11), randn(d, Fd, seed=12)
    y = srelu24_ffn(x, w1, w2, SReLU24Recipe())
    _, a, m, ref = _ref_forward(x, w1, w2)
    assert rel_err(y, ref) < 1e-12
    # and it is not plain srelu (the mask dropped something)
    assert rel_err(y, a @ w2.t()) > 1e-3
    # leading dims are kept
    y3 = srelu24_ffn(x.view(2, 12, d), w1, w2, SReLU24Recipe())
    assert y3.shape == (2, 12, d) and rel_err(y3.view(T, d), ref) < 1e-12


def test_forward_activations_are_2to4():
    # a square, well-conditioned W2 lets us recover the activation that fed it
    T, d, Fd = 16, 32, 32
    x, w1 = randn(T, d, seed=13), randn(Fd, d, seed=14)
    w2 = randn(d, Fd, seed=15) + 8 * torch.eye(d, dtype=torch.float64)
    y = srelu24_ffn(x, w1, w2, SReLU24Recipe())
    act = torch.linalg.solve(w2, y.t()).t()  # y = act w2^T
    nz = act.abs() > 1e-8
    assert (groups_of_4(nz, -1).sum(-1) <= 2).all()
    _, a, m, _ = _ref_forward(x, w1, w2)
    assert rel_err(act, a * m) < 1e-10


# ---------------------------------------------------------------- srelu24_ffn backward

T_, D_, F_ = 32, 16, 64


def _inputs(seed=20, T=T_, d=D_, Fd=F_):
    return randn(T, d, seed=seed), randn(Fd, d, seed=seed + 1), randn(d, Fd, seed=seed + 2), randn(T, d, seed=seed + 3)


def _run(x, w1, w2, dy, recipe, seed=0):
    x, w1, w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = srelu24_ffn(x, w1, w2, recipe)
    torch.manual_seed(seed)
    y.backward(dy)
    return y.detach(), x.grad, w1.grad, w2.grad


def _manual(x, w1, w2, dy):
    z, a, m, y = _ref_forward(x, w1, w2)
    da = dy @ w2
    dz_masked = da * 2 * F.relu(z) * m
    dz_unmasked = da * 2 * F.relu(z)
    return dict(y=y, a24=a * m, dz=dz_masked, dz_nomask=dz_unmasked)


def test_dx_reuses_the_forward_mask():
    x, w1, w2, dy = _inputs()
    r = _manual(x, w1, w2, dy)
    _, dx, _, _ = _run(x, w1, w2, dy, SReLU24Recipe(reuse_forward_mask=True))
    assert rel_err(dx, r["dz"] @ w1) < 1e-12
    _, dx_nm, _, _ = _run(x, w1, w2, dy, SReLU24Recipe(reuse_forward_mask=False))
    assert rel_err(dx_nm, r["dz_nomask"] @ w1) < 1e-12
    assert rel_err(dx_nm, dx) > 0.05
    # with the mask, dX is the exact gradient of the (masked) forward function
    xa = x.clone().requires_grad_()
    _ref_forward(xa, w1, w2)[3].backward(dy)
    assert rel_err(dx, xa.grad) < 1e-12


def test_weight_grads_unpermuted_no_dense_features():
    x, w1, w2, dy = _inputs()
    r = _manual(x, w1, w2, dy)
    _, _, dw1, dw2 = _run(x, w1, w2, dy, SReLU24Recipe(token_permutation=False, dense_feature_fraction=0.0))
    assert rel_err(dw2, dy.t() @ ref_token_sparsify(r["a24"])) < 1e-12
    assert rel_err(dw1, ref_token_sparsify(r["dz"]).t() @ x) < 1e-12
    # and that is not the exact dense gradient
    assert rel_err(dw2, dy.t() @ r["a24"]) > 0.01
    assert rel_err(dw1, r["dz"].t() @ x) > 0.01


def test_weight_grads_unpermuted_with_dense_features():
    x, w1, w2, dy = _inputs()
    r = _manual(x, w1, w2, dy)
    frac = 0.25
    dense = ref_densest(r["a24"], frac)
    assert len(dense) == 16
    _, _, dw1, dw2 = _run(x, w1, w2, dy, SReLU24Recipe(token_permutation=False, dense_feature_fraction=frac))
    # the densest features get the exact gradient
    assert rel_err(dw2[:, dense], dy.t() @ r["a24"][:, dense]) < 1e-12
    assert rel_err(dw1[dense], r["dz"][:, dense].t() @ x) < 1e-12
    # ... which the 2:4 path would not have given them
    assert rel_err(ref_token_sparsify(r["a24"])[:, dense], r["a24"][:, dense]) > 0.01
    # the rest go through the token 2:4
    other = [j for j in range(F_) if j not in dense]
    assert rel_err(dw2[:, other], dy.t() @ ref_token_sparsify(r["a24"])[:, other]) < 1e-12
    assert rel_err(dw1[other], ref_token_sparsify(r["dz"])[:, other].t() @ x) < 1e-12


def test_permutation_depends_on_rng_and_is_reproducible():
    x, w1, w2, dy = _inputs()
    rec = SReLU24Recipe(token_permutation=True, dense_feature_fraction=0.0)
    a = _run(x, w1, w2, dy, rec, seed=1)
    b = _run(x, w1, w2, dy, rec, seed=1)
    c = _run(x, w1, w2, dy, rec, seed=2)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])  # y and dX do not depend on it
    assert rel_err(c[2], a[2]) > 1e-3 and rel_err(c[3], a[3]) > 1e-3
    # a permuted run equals the unpermuted formula applied to the permuted tokens
    perm = (torch.manual_seed(1), torch.randperm(T_))[1]
    r = _manual(x, w1, w2, dy)
    assert rel_err(a[3], dy[perm].t() @ ref_token_sparsify(r["a24"][perm])) < 1e-12
    assert rel_err(a[2], ref_token_sparsify(r["dz"][perm]).t() @ x[perm]) < 1e-12


def _sparse_runs_inputs(run, T=256, d=16, Fd=64, seed=30, bias=1.3):
    """Tokens repeat in runs of `run` (as consecutive tokens fire the same features), and a
    negative bias through a constant input feature makes ~90% of activations zero."""
    x = randn(T // run, d, seed=seed).repeat_interleave(run, 0)
    x[:, 0] = 1.0 + 0.1 * torch.rand(T, generator=gen(seed + 1), dtype=torch.float64)
    w1 = randn(Fd, d, seed=seed + 2)
    w1[:, 0] = -bias * math.sqrt(d - 1)
    return x, w1, randn(d, Fd, seed=seed + 3), randn(T, d, seed=seed + 4)


def test_weight_grads_close_to_exact_when_activations_sparse():
    x, w1, w2, dy = _sparse_runs_inputs(run=1)
    r = _manual(x, w1, w2, dy)
    density = (r["a24"] != 0).double().mean().item()
    assert 0.03 < density < 0.15
    _, _, dw1, dw2 = _run(x, w1, w2, dy, SReLU24Recipe(token_permutation=True, dense_feature_fraction=0.0))
    assert rel_err(dw2, dy.t() @ r["a24"]) < 0.1
    assert rel_err(dw1, r["dz"].t() @ x) < 0.1


def test_token_permutation_rescues_runs_of_identical_tokens():
    x, w1, w2, dy = _sparse_runs_inputs(run=8)
    r = _manual(x, w1, w2, dy)
    exact2, exact1 = dy.t() @ r["a24"], r["dz"].t() @ x
    _, _, u1, u2 = _run(x, w1, w2, dy, SReLU24Recipe(token_permutation=False, dense_feature_fraction=0.0))
    _, _, p1, p2 = _run(x, w1, w2, dy, SReLU24Recipe(token_permutation=True, dense_feature_fraction=0.0))
    eu1, eu2, ep1, ep2 = (rel_err(g, e) for g, e in [(u1, exact1), (u2, exact2), (p1, exact1), (p2, exact2)])
    assert eu1 > 0.25 and eu2 > 0.25  # without permutation, half of each run is dropped
    assert ep1 < 0.1 and ep2 < 0.1
    assert ep1 < eu1 / 4 and ep2 < eu2 / 4


@pytest.mark.parametrize("perm", [False, True])
def test_toggling_reuse_forward_mask_changes_only_dx_and_dw1(perm):
    x, w1, w2, dy = _inputs()
    a = _run(x, w1, w2, dy, SReLU24Recipe(perm, 0.05, True), seed=3)
    b = _run(x, w1, w2, dy, SReLU24Recipe(perm, 0.05, False), seed=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])  # y, dW2
    assert rel_err(b[1], a[1]) > 0.01 and rel_err(b[2], a[2]) > 0.01  # dX, dW1


@pytest.mark.parametrize("perm", [False, True])
def test_toggling_dense_feature_fraction_changes_only_weight_grads(perm):
    x, w1, w2, dy = _inputs()
    a = _run(x, w1, w2, dy, SReLU24Recipe(perm, 0.0, True), seed=4)
    b = _run(x, w1, w2, dy, SReLU24Recipe(perm, 0.25, True), seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # y, dX
    assert rel_err(b[2], a[2]) > 0.01 and rel_err(b[3], a[3]) > 0.01


def test_toggling_token_permutation_changes_only_weight_grads():
    x, w1, w2, dy = _inputs()
    a = _run(x, w1, w2, dy, SReLU24Recipe(False, 0.05, True), seed=5)
    b = _run(x, w1, w2, dy, SReLU24Recipe(True, 0.05, True), seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert rel_err(b[2], a[2]) > 0.01 and rel_err(b[3], a[3]) > 0.01


def test_backward_with_3d_input_and_partial_token_group():
    B, S, d, Fd = 2, 5, 16, 32  # 10 tokens: the last token group is partial
    x = randn(B, S, d, seed=40, dtype=torch.float32).requires_grad_()
    w1 = randn(Fd, d, seed=41, dtype=torch.float32).requires_grad_()
    w2 = randn(d, Fd, seed=42, dtype=torch.float32).requires_grad_()
    y = srelu24_ffn(x, w1, w2, SReLU24Recipe(token_permutation=False, dense_feature_fraction=0.0))
    assert y.shape == (B, S, d)
    dy = randn(B, S, d, seed=43, dtype=torch.float32)
    y.backward(dy)
    assert x.grad.shape == x.shape and w1.grad.shape == w1.shape and w2.grad.shape == w2.shape
    r = _manual(x.detach().double().view(-1, d), w1.detach().double(), w2.detach().double(), dy.double().view(-1, d))
    assert rel_err(x.grad.view(-1, d), r["dz"] @ w1.detach().double()) < 1e-5
    assert rel_err(w2.grad, dy.double().view(-1, d).t() @ ref_token_sparsify(r["a24"])) < 1e-5


# ---------------------------------------------------------------- the SReLU24 module


def _pair(d=32, h=64, seed=50, recipe=SReLU24Recipe()):
    torch.manual_seed(seed)
    dense = SReLU(d, h).double()
    sp = SReLU24(d, h, OpOptions(recipe)).double()
    sp.load_state_dict(dense.state_dict())
    return dense, sp


def test_srelu24_dense_mode_is_exactly_srelu():
    dense, sp = _pair()
    assert sp.sparse is False
    x = randn(3, 8, 32, seed=51)
    dy = randn(3, 8, 32, seed=52)
    grads = []
    for m in (dense, sp):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy)
        grads.append((y.detach(), xi.grad, m.w1.weight.grad, m.w2.weight.grad))
    for u, v in zip(*grads):
        assert torch.equal(u, v)


def test_srelu24_sparse_mode_feeds_w2_a_2to4_activation():
    d = h = 32
    dense, sp = _pair(d, h)
    with torch.no_grad():
        sp.w2.weight.add_(8 * torch.eye(d, dtype=torch.float64))
    sp.sparse = True
    x = randn(4, 6, d, seed=53)
    y = sp(x)
    assert y.shape == x.shape
    act = torch.linalg.solve(sp.w2.weight.detach(), y.detach().reshape(-1, d).t()).t()
    assert (groups_of_4(act.abs() > 1e-8, -1).sum(-1) <= 2).all()
    a = F.relu(x.reshape(-1, d) @ sp.w1.weight.detach().t()).square()
    assert rel_err(act, a * ref_mask_2to4(a)) < 1e-10
    assert torch.equal(y, srelu24_ffn(x, sp.w1.weight, sp.w2.weight, sp.recipe))
    sp.sparse = False
    assert rel_err(sp(x), y) > 1e-3  # the switch does something


def test_srelu24_sparse_mode_uses_its_recipe():
    rec = SReLU24Recipe(token_permutation=False, dense_feature_fraction=0.0, reuse_forward_mask=False)
    _, sp = _pair(recipe=rec)
    sp.sparse = True
    x, dy = randn(8, 32, seed=54), randn(8, 32, seed=55)
    xi = x.clone().requires_grad_()
    sp(xi).backward(dy)
    r = _manual(x, sp.w1.weight.detach(), sp.w2.weight.detach(), dy)
    assert rel_err(xi.grad, r["dz_nomask"] @ sp.w1.weight.detach()) < 1e-12
    assert rel_err(sp.w2.weight.grad, dy.t() @ ref_token_sparsify(r["a24"])) < 1e-12


def test_srelu24_warns_once_about_reference_path(monkeypatch, caplog):
    monkeypatch.setattr(ffn_mod, "_warned", False)
    _, sp = _pair()
    sp.sparse = True
    x = randn(4, 32, seed=56)
    sp(x)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "reference" in warned[0]
    sp(x)  # no second warning
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_transformer_set_2to4_flips_every_layer():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, swiglu_hidden=64, max_seq_len=32)
    m = Transformer(cfg, FFNConfig(kind="srelu24"), 50)
    ffns = [layer.feed_forward for layer in m.layers]
    assert all(isinstance(f, SReLU24) for f in ffns) and len(ffns) == 3
    assert not any(f.sparse for f in ffns)  # dense warmup first
    tok = torch.randint(0, 50, (2, 12), generator=gen(1))
    dense_logits = m(tok)
    m.set_2to4(True)
    assert all(f.sparse for f in ffns)
    sparse_logits = m(tok)
    assert rel_err(sparse_logits, dense_logits) > 1e-4
    loss = m(tok, torch.randint(0, 50, (2, 12), generator=gen(2)))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    m.set_2to4(False)
    assert not any(f.sparse for f in ffns)
    assert torch.equal(m(tok), dense_logits)
    # a no-op for the other FFNs
    m2 = Transformer(cfg, FFNConfig(kind="srelu"), 50)
    before = m2(tok)
    m2.set_2to4(True)
    assert torch.equal(m2(tok), before)


def test_random_token_order_is_an_int32_permutation_from_the_cpu_generator():
    """Drawn on the host (a GPU randperm is a dozen sort launches per layer), reproducible from
    torch.manual_seed, on the device asked for."""
    from srelu24_kernels.srelu24.reference import random_token_order

    torch.manual_seed(5)
    a = random_token_order(1000, "cpu")
    torch.manual_seed(5)
    b = random_token_order(1000, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.device.type == "cpu" and torch.equal(a, b)
    assert torch.equal(a.sort().values, torch.arange(1000, dtype=torch.int32)) and not torch.equal(a, a.sort().values)
