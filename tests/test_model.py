"""Tests of model/: config -> FFN sizes, parameter and FLOP accounting, the Transformer's
forward (shapes, loss, causality, GQA, tied embeddings, init) and its numerical identity
with Hugging Face's Llama (skipped when `transformers` is not installed)."""
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from srelu24_kernels.srelu24.reference import SReLU24Recipe
from model import FFN_REGISTRY, FFNConfig, ModelConfig, Transformer, ffn_hidden_dim, model_size, register_ffn
from model.ffn import FFN, SReLU, SReLU24, SwiGLU, build_ffn
from model.transformer import HF_NAMES, Attention, RMSNorm, apply_rope, rope_tables

pytestmark = pytest.mark.filterwarnings("ignore:srelu24. using the pure-PyTorch")

KINDS = ["swiglu", "srelu", "srelu24"]

# name: (dim, n_layers, n_heads, swiglu_hidden, vocab)
SIZES = {
    "tiny": (128, 4, 4, 512, 32000),
    "125m": (768, 12, 12, 2048, 32000),
    "350m": (1024, 24, 16, 2816, 32000),
    "1b": (2048, 20, 16, 5632, 32000),
    "7b": (4096, 32, 32, 11008, 32000),
}
SEQ = 2048


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def cfg_of(name, **kw):
    dim, L, H, h, _ = SIZES[name]
    return ModelConfig(name=name, dim=dim, n_layers=L, n_heads=H, swiglu_hidden=h, **kw)


def meta_model(name, kind, **ffn_kw):
    with torch.device("meta"):
        return Transformer(cfg_of(name), FFNConfig(kind=kind, **ffn_kw), SIZES[name][4])


def small_cfg(**kw):
    base = dict(name="t", dim=64, n_layers=2, n_heads=4, swiglu_hidden=128, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


def small_model(kind="swiglu", vocab=97, seed=0, ffn_kw=None, **kw):
    torch.manual_seed(seed)
    return Transformer(small_cfg(**kw), FFNConfig(kind=kind, **(ffn_kw or {})), vocab)


def tokens(B, S, V, seed=1):
    return torch.randint(0, V, (B, S), generator=gen(seed))


# ---------------------------------------------------------------- FFN sizes, params, FLOPs

EXPECTED_SRELU_HIDDEN = {"tiny": 768, "125m": 3072, "350m": 4224, "1b": 8448, "7b": 16512}


@pytest.mark.parametrize("name", list(SIZES))
def test_srelu_hidden_is_1p5x_swiglu_rounded_to_128(name):
    cfg = cfg_of(name)
    sw = ffn_hidden_dim(cfg, FFNConfig(kind="swiglu"))
    assert sw == cfg.swiglu_hidden
    for kind in ("srelu", "srelu24"):
        h = ffn_hidden_dim(cfg, FFNConfig(kind=kind))
        assert h % 128 == 0
        assert abs(h - 1.5 * sw) <= 64  # nearest multiple of 128
        assert h == EXPECTED_SRELU_HIDDEN[name]
        m = meta_model(name, kind)
        for layer in m.layers:
            assert layer.feed_forward.w1.weight.shape == (h, cfg.dim)
            assert layer.feed_forward.w2.weight.shape == (cfg.dim, h)


@pytest.mark.parametrize("swiglu_hidden,expected", [(1000, 1536), (1100, 1664), (600, 896), (10, 128)])
def test_srelu_hidden_rounds_to_nearest_128_with_floor(swiglu_hidden, expected):
    # 1500 -> 1536, 1650 -> 1664, 900 -> 896 (rounds down), 15 -> at least 128
    cfg = ModelConfig(swiglu_hidden=swiglu_hidden)
    assert ffn_hidden_dim(cfg, FFNConfig(kind="srelu")) == expected
    assert ffn_hidden_dim(cfg, FFNConfig(kind="srelu24")) == expected


@pytest.mark.parametrize("name", list(SIZES))
def test_variants_match_params_and_flops_within_1pct(name):
    sizes = {k: model_size(meta_model(name, k), SEQ) for k in KINDS}
    ref = sizes["swiglu"]
    for k in ("srelu", "srelu24"):
        s = sizes[k]
        assert abs(s.total - ref.total) / ref.total < 0.01, (k, s.total, ref.total)
        assert abs(s.non_embedding - ref.non_embedding) / ref.non_embedding < 0.01
        assert abs(s.flops_per_token - ref.flops_per_token) / ref.flops_per_token < 0.01
    # srelu and srelu24 are the same network
    assert sizes["srelu"] == sizes["srelu24"]


def test_7b_swiglu_is_llama2_7b():
    s = model_size(meta_model("7b", "swiglu"), 4096)
    assert s.total == 6_738_415_616
    assert s.embedding == 32000 * 4096
    assert s.output == 32000 * 4096
    assert s.non_embedding == s.total - 2 * 32000 * 4096


def test_1b_non_embedding_is_about_1b():
    for k in KINDS:
        s = model_size(meta_model("1b", k), SEQ)
        assert 0.9e9 <= s.non_embedding <= 1.1e9, (k, s.non_embedding)


def test_ffn_modules_output_shapes():
    d, h = 48, 96
    x = torch.randn(2, 5, d, generator=gen(3))
    for kind, cls in [("swiglu", SwiGLU), ("srelu", SReLU), ("srelu24", SReLU24)]:
        m = build_ffn(FFNConfig(kind=kind), d, h)
        assert type(m) is cls
        assert m.w1.weight.shape == (h, d) and m.w2.weight.shape == (d, h)
        if kind == "swiglu":
            assert m.w3.weight.shape == (h, d)
        y = m(x)
        assert y.shape == x.shape
        assert torch.isfinite(y).all() and y.abs().sum() > 0
    m = build_ffn(FFNConfig(kind="srelu24"), d, h)
    m.sparse = True
    y = m(x)
    assert y.shape == x.shape


def test_build_ffn_rejects_unknown_kind_and_bad_srelu24_hidden():
    with pytest.raises(ValueError):
        build_ffn(FFNConfig(kind="gelu"), 16, 32)
    with pytest.raises(ValueError):
        build_ffn(FFNConfig(kind="srelu24"), 16, 30)


def test_unknown_ffn_kind_is_one_line_naming_the_registered_kinds():
    with pytest.raises(ValueError) as e:
        FFNConfig(kind="gelu")
    assert str(e.value) == "ffn.kind=gelu is not a registered FFN; valid kinds: [swiglu, srelu, srelu24]"
    assert list(FFN_REGISTRY) == KINDS


def test_a_new_ffn_is_its_class_and_registration():
    """What adding a variant takes in Python: the class, registered. The model builds it by name,
    sizes it by its default_hidden, and initialises its declared residual projection with the
    residual std (the other FFN weights with init_std), whatever the weights are called."""
    @register_ffn("relu_test")
    class ReLUFFN(FFN):
        def __init__(self, dim, hidden):
            super().__init__()
            self.up = nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)

        @staticmethod
        def default_hidden(swiglu_hidden):
            return 2 * swiglu_hidden

        def residual_projections(self):
            return [self.down.weight]

        def forward(self, x):
            return self.down(F.relu(self.up(x)))

    try:
        cfg = small_cfg(dim=256, swiglu_hidden=512, n_layers=8, init_std=0.02)
        ffn = FFNConfig(kind="relu_test")
        assert ffn_hidden_dim(cfg, ffn) == 1024
        torch.manual_seed(0)
        m = Transformer(cfg, ffn, 50)
        f = m.layers[0].feed_forward
        assert type(f) is ReLUFFN and f.up.weight.shape == (1024, 256)
        assert f.up.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert f.down.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
        m.set_2to4(True)  # a no-op for a dense variant
        assert m(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 50)
        with pytest.raises(ValueError, match="registered twice"):
            register_ffn("relu_test")(ReLUFFN)
    finally:
        del FFN_REGISTRY["relu_test"]


@pytest.mark.parametrize("kind", KINDS)
def test_ffn_hidden_dim_override_wins(kind):
    cfg = small_cfg()
    assert ffn_hidden_dim(cfg, FFNConfig(kind=kind, hidden_dim=320)) == 320
    m = Transformer(cfg, FFNConfig(kind=kind, hidden_dim=320), 50)
    for layer in m.layers:
        assert layer.feed_forward.w1.out_features == 320
        assert layer.feed_forward.w2.in_features == 320


def test_block_passes_the_recipe_to_srelu24():
    ffn = FFNConfig(kind="srelu24", token_permutation=False, dense_feature_fraction=0.125,
                    reuse_forward_mask=True)
    m = Transformer(small_cfg(), ffn, 50)
    for layer in m.layers:
        assert layer.feed_forward.recipe == SReLU24Recipe(token_permutation=False, dense_feature_fraction=0.125,
                                                           reuse_forward_mask=True)


# ---------------------------------------------------------------- flops


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_flops_definition(kind, tie):
    m = small_model(kind, vocab=211, tie_embeddings=tie)
    S = 37
    s = model_size(m, S)
    linear = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))
    # every Linear counts, the LM head included (tied or not, the head is a matmul)
    assert s.matmul == linear
    assert m.output.weight.numel() == 211 * 64
    cfg = m.cfg
    h = ffn_hidden_dim(cfg, m.ffn_cfg)
    n_ffn_mats = 3 if kind == "swiglu" else 2
    assert s.matmul == cfg.n_layers * (4 * cfg.dim ** 2 + n_ffn_mats * cfg.dim * h) + 211 * cfg.dim
    assert s.flops_per_token == 6 * s.matmul + 12 * cfg.n_layers * cfg.dim * S
    assert s.attention_flops_per_token == 12 * cfg.n_layers * cfg.dim * S
    assert s.forward_flops_per_token == s.flops_per_token // 3
    assert (s.n_layers, s.dim, s.seq_len) == (cfg.n_layers, cfg.dim, S)


def test_flops_7b_closed_form():
    s = model_size(meta_model("7b", "swiglu"), 4096)
    d, L, V, h = 4096, 32, 32000, 11008
    matmul = L * (4 * d * d + 3 * d * h) + V * d
    assert s.matmul == matmul
    assert s.matmul == s.total - V * d - (2 * L + 1) * d  # all but embedding and norms
    assert s.flops_per_token == 6 * matmul + 12 * L * d * 4096


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("kind", KINDS)
def test_forward_logits_shape_and_loss(kind):
    V = 97
    m = small_model(kind, vocab=V)
    x = tokens(3, 11, V)
    y = tokens(3, 11, V, seed=2)
    logits = m(x)
    assert logits.shape == (3, 11, V)
    assert logits.dtype == torch.float32
    loss = m(x, y)
    assert loss.dim() == 0
    ref = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    assert rel_err(loss, ref) < 1e-6
    # at init the loss is near log(V)
    assert abs(loss.item() - math.log(V)) < 0.5
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_forward_rejects_too_long_sequence():
    m = small_model(max_seq_len=16)
    with pytest.raises(ValueError):
        m(tokens(1, 17, 97))


def _check_causal(m, V, B=2, S=12):
    x = tokens(B, S, V, seed=5)
    base = m(x)
    for t in (0, 5, S - 1):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1 + torch.randint(0, V - 1, (B,), generator=gen(t))) % V
        assert (x2[:, t] != x[:, t]).all()
        out = m(x2)
        if t > 0:
            assert rel_err(out[:, :t], base[:, :t]) < 1e-6, t
        # the changed position itself (and later ones) do change
        assert rel_err(out[:, t:], base[:, t:]) > 1e-3, t


@pytest.mark.parametrize("kind", KINDS)
def test_causal(kind):
    V = 97
    m = small_model(kind, vocab=V)
    with torch.no_grad():
        _check_causal(m, V)


def test_causal_with_srelu24_sparse_on():
    V = 97
    m = small_model("srelu24", vocab=V)
    m.set_2to4(True)
    with torch.no_grad():
        _check_causal(m, V)


def test_gqa_runs_causal_and_equals_repeated_kv_heads():
    V = 97
    gqa = small_model(vocab=V, n_heads=4, n_kv_heads=2, seed=3)
    hd = 64 // 4
    assert gqa.layers[0].attention.wk.weight.shape == (2 * hd, 64)
    x = tokens(2, 10, V)
    out = gqa(x)
    assert out.shape == (2, 10, V)
    with torch.no_grad():
        _check_causal(gqa, V)
    # MHA with each kv head repeated for its group of query heads must give the same logits
    mha = small_model(vocab=V, n_heads=4, n_kv_heads=None, seed=4)
    sd = gqa.state_dict()
    for k in list(sd):
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            sd[k] = sd[k].view(2, hd, 64).repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    with torch.no_grad():
        assert rel_err(mha(x), gqa(x)) < 1e-5
        # and the grouping matters: repeat (instead of repeat_interleave) is a different model
        sd2 = gqa.state_dict()
        for k in list(sd2):
            if k.endswith(("attention.wk.weight", "attention.wv.weight")):
                sd2[k] = sd2[k].view(2, hd, 64).repeat(2, 1, 1).reshape(4 * hd, 64)
        mha.load_state_dict(sd2)
        assert rel_err(mha(x), gqa(x)) > 1e-3


def test_bad_head_counts_raise():
    with pytest.raises(ValueError):
        Transformer(small_cfg(dim=64, n_heads=5), FFNConfig(), 10)
    with pytest.raises(ValueError):
        Transformer(small_cfg(n_heads=4, n_kv_heads=3), FFNConfig(), 10)


def test_tied_embeddings_share_storage_and_count_once():
    V = 97
    tied = small_model(vocab=V, tie_embeddings=True)
    untied = small_model(vocab=V, tie_embeddings=False)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    st, su = model_size(tied, 16), model_size(untied, 16)
    n_params = sum(p.numel() for p in tied.parameters())  # parameters() deduplicates
    assert st.total == n_params == su.total - V * 64
    assert st.output == 0 and su.output == V * 64
    assert st.embedding == su.embedding == V * 64
    assert st.non_embedding == su.non_embedding
    assert st.matmul == su.matmul  # the tied head is still a matmul
    # a change to the embedding shows up in the head
    with torch.no_grad():
        tied.tok_embeddings.weight[3].add_(torch.randn(64, generator=gen(0)))
    assert torch.equal(tied.output.weight[3], tied.tok_embeddings.weight[3])
    # both uses contribute to the one gradient
    x = tokens(2, 8, V)
    tied(x, tokens(2, 8, V, seed=9)).backward()
    assert tied.output.weight.grad is tied.tok_embeddings.weight.grad


@pytest.mark.parametrize("kind", KINDS)
def test_init_stds(kind):
    std, L = 0.05, 4
    torch.manual_seed(11)
    m = Transformer(ModelConfig(dim=256, n_layers=L, n_heads=4, swiglu_hidden=512, init_std=std),
                    FFNConfig(kind=kind), 1000)
    resid = std / math.sqrt(2 * L)
    seen = set()
    for name, p in m.named_parameters():
        p = p.detach()
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            seen.add("norm")
            continue
        expected = resid if name.endswith(("wo.weight", "w2.weight")) else std
        assert abs(p.std().item() / expected - 1) < 0.05, (name, p.std().item(), expected)
        assert abs(p.mean().item()) < 0.05 * expected, name
        seen.add(name.split(".")[-2])
    expected_kinds = {"norm", "tok_embeddings", "output", "wq", "wk", "wv", "wo", "w1", "w2"}
    if kind == "swiglu":
        expected_kinds.add("w3")
    assert seen == expected_kinds


# ---------------------------------------------------------------- RMSNorm, RoPE, attention
# (the HF test below checks these end to end; these run without transformers)


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_rmsnorm_formula(scale):
    eps = 1e-5
    norm = RMSNorm(48, eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(48, generator=gen(0)))
    x = scale * torch.randn(3, 7, 48, generator=gen(1))
    ref = norm.weight.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    assert rel_err(norm(x), ref) < 1e-6


def _rope_reference(x, theta):
    """Rotate each pair (x_i, x_{i + hd/2}) at position m by the angle m * theta^(-2i/hd)."""
    S, hd = x.shape[-2], x.shape[-1]
    i = torch.arange(hd // 2, dtype=torch.float64)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * theta ** (-2 * i / hd)
    c = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2:].double()) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([c.real, c.imag], dim=-1)


def test_rope_is_rotate_half_rotation():
    theta, hd, S = 500000.0, 16, 40
    cos, sin = rope_tables(hd, 64, theta)
    assert cos.shape == sin.shape == (64, hd)
    x = torch.randn(2, 3, S, hd, generator=gen(2))
    out = apply_rope(x, cos[:S], sin[:S])
    assert rel_err(out, _rope_reference(x, theta)) < 1e-5
    # scores q.k depend only on the offset: shifting both positions leaves them unchanged
    q, k = torch.randn(hd, generator=gen(3)), torch.randn(hd, generator=gen(4))
    qs = apply_rope(q.expand(1, 1, S, hd), cos[:S], sin[:S])[0, 0]
    ks = apply_rope(k.expand(1, 1, S, hd), cos[:S], sin[:S])[0, 0]
    assert abs((qs[9] @ ks[4]) - (qs[30] @ ks[25])).item() < 1e-4 * (q.norm() * k.norm()).item()
    assert abs((qs[9] @ ks[4]) - (qs[9] @ ks[5])).item() > 1e-4


def test_transformer_rope_tables_follow_config():
    m = small_model(rope_theta=1000.0, max_seq_len=48)
    cos, sin = rope_tables(16, 48, 1000.0)
    assert torch.equal(m.rope_cos, cos) and torch.equal(m.rope_sin, sin)
    assert rel_err(rope_tables(16, 48, 10000.0)[1], sin) > 1e-3
    assert "rope_cos" not in m.state_dict()  # derived, not checkpointed


def test_attention_matches_manual_gqa():
    cfg = small_cfg(n_heads=4, n_kv_heads=2, rope_theta=1000.0)
    torch.manual_seed(0)
    att = Attention(cfg)
    B, S, hd = 2, 9, 16
    cos, sin = rope_tables(hd, 64, 1000.0)
    x = torch.randn(B, S, 64, generator=gen(5))
    out = att(x, cos[:S], sin[:S])
    xd = x.double()
    q = (xd @ att.wq.weight.double().t()).view(B, S, 4, hd).transpose(1, 2)
    k = (xd @ att.wk.weight.double().t()).view(B, S, 2, hd).transpose(1, 2)
    v = (xd @ att.wv.weight.double().t()).view(B, S, 2, hd).transpose(1, 2)
    q, k = _rope_reference(q, 1000.0), _rope_reference(k, 1000.0)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # query head h uses kv head h // 2
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, 64)
    ref = o @ att.wo.weight.double().t()
    assert rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------- Hugging Face Llama


def _layer_template(name):
    return re.sub(r"^layers\.\d+\.", "layers.{i}.", name)


def _hf_name(name):
    i = re.match(r"layers\.(\d+)\.", name)
    return HF_NAMES[_layer_template(name)].format(i=i.group(1) if i else "")


def test_hf_names_cover_every_swiglu_parameter():
    m = small_model("swiglu", n_layers=3)
    names = [n for n, _ in m.named_parameters()]
    assert {_layer_template(n) for n in names} == set(HF_NAMES)
    assert len({_hf_name(n) for n in names}) == len(names)  # one-to-one


def test_matches_hf_llama_logits():
    transformers = pytest.importorskip("transformers")
    V, dim, L, H, KV, hidden, theta, eps = 101, 64, 2, 4, 2, 176, 500000.0, 1e-6
    cfg = ModelConfig(dim=dim, n_layers=L, n_heads=H, n_kv_heads=KV, swiglu_hidden=hidden, max_seq_len=128,
                      rope_theta=theta, norm_eps=eps)
    torch.manual_seed(0)
    ours = Transformer(cfg, FFNConfig(kind="swiglu"), V).float().eval()
    with torch.no_grad():  # norm weights are ones at init; randomise them so their mapping is tested
        for n, p in ours.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen(len(n))))
    hf_cfg = transformers.LlamaConfig(
        hidden_size=dim, intermediate_size=hidden, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=KV, rms_norm_eps=eps, rope_theta=theta, vocab_size=V, max_position_embeddings=128,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu")
    hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    hf_sd = hf.state_dict()
    new = {}
    for n, p in ours.state_dict().items():
        hf_name = _hf_name(n)
        assert hf_name in hf_sd and hf_sd[hf_name].shape == p.shape, hf_name
        new[hf_name] = p
    missing = {k for k in hf_sd if k not in new and "rotary" not in k}
    assert not missing
    hf.load_state_dict(new, strict=False)
    x = tokens(2, 40, V)
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-5


def test_compiled_loss_head_equals_eager():
    """trainer.compile compiles Transformer.loss (norm + output + cross-entropy) on the instance:
    same loss and gradients as eager, parameter names unchanged."""
    m = small_model(seed=3)
    tokens = torch.randint(0, 97, (2, 16), generator=gen(1))
    targets = torch.randint(0, 97, (2, 16), generator=gen(2))
    names = [n for n, _ in m.named_parameters()]
    losses, grads = [], []
    for compiled in (False, True):
        m.zero_grad()
        if compiled:
            m.loss = torch.compile(m.loss)
        loss = m(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in m.parameters()])
    assert [n for n, _ in m.named_parameters()] == names
    assert torch.allclose(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for g1, g0 in zip(grads[1], grads[0]):
        assert torch.allclose(g1, g0, rtol=1e-4, atol=1e-6)
