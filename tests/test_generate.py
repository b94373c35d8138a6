"""Text generation: the KV-cached forward against the full forward (prefill, decode, chunks;
GQA; srelu24 with 2:4 on), greedy/top-k/temperature sampling, eos and the context limit,
and scripts/sample.py on a real tiny run's checkpoints."""
import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from helpers import BASE_ENV, ROOT, background, run_train, tiny_overrides, write_corpus
from model import FFNConfig, ModelConfig, Transformer
from model.generate import generate, sample_next

pytestmark = pytest.mark.filterwarnings("ignore:srelu24. using the pure-PyTorch")

V = 97
MAX_LEN = 24


def make_model(kind: str, n_kv_heads=2, init_std=0.1, seed=0) -> Transformer:
    """4 query heads over 2 KV heads (GQA). A larger init_std than training's keeps the logits
    apart, so greedy choices are not decided by float rounding."""
    torch.manual_seed(seed)
    cfg = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, swiglu_hidden=128,
                      max_seq_len=MAX_LEN, init_std=init_std)
    m = Transformer(cfg, FFNConfig(kind=kind), V).eval()
    m.set_2to4(kind == "srelu24")
    return m


MODELS = ["swiglu", "srelu24"]


def tokens(B, S, seed=1):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def cached_logits(m: Transformer, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Run x through the cache in consecutive chunks of the given sizes; the logits of all positions."""
    cache = m.new_cache(batch_size=x.shape[0])
    out, pos = [], 0
    for n in chunks:
        out.append(m(x[:, pos:pos + n], cache=cache, start_pos=pos))
        pos += n
    assert pos == x.shape[1]
    return torch.cat(out, dim=1)


# ---------------------------------------------------------------- cached forward == full forward

@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("chunks", [[7] + [1] * 13, [1] * 20, [5, 4, 1, 6, 3, 1], [20]],
                         ids=["prefill+decode", "decode-only", "chunked", "prefill-only"])
@torch.no_grad()
def test_cached_forward_matches_full_forward(kind, chunks):
    m = make_model(kind)
    x = tokens(2, 20)
    full = m(x)
    got = cached_logits(m, x, chunks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_cached_forward_mha_and_full_context():
    """Without GQA, and filling the cache to model.max_seq_len exactly."""
    m = make_model("swiglu", n_kv_heads=None)
    x = tokens(1, MAX_LEN, seed=3)
    torch.testing.assert_close(cached_logits(m, x, [3, 9] + [1] * 12), m(x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_srelu24_cache_test_really_is_sparse():
    """The srelu24 model above runs 2:4: its logits differ from the dense warmup's."""
    m = make_model("srelu24")
    x = tokens(1, 12)
    sparse = m(x)
    m.set_2to4(False)
    assert (sparse - m(x)).abs().max() > 1e-3


@torch.no_grad()
def test_cache_bounds_are_checked():
    m = make_model("swiglu")
    cache = m.new_cache(max_len=8)
    m(tokens(1, 8), cache=cache)
    with pytest.raises(ValueError, match="cache"):
        m(tokens(1, 1), cache=cache, start_pos=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.new_cache(max_len=MAX_LEN + 1)
    with pytest.raises(ValueError, match="start_pos"):
        m(tokens(1, 2), start_pos=3)


# ---------------------------------------------------------------- sampling

def greedy_without_cache(m: Transformer, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            if len(seq) > MAX_LEN:
                break
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("kind", MODELS)
def test_greedy_with_cache_equals_recomputing(kind):
    m = make_model(kind)
    prompt = tokens(1, 5, seed=7)[0].tolist()
    ref = greedy_without_cache(m, prompt, 10)
    assert len(ref) == 10 and len(set(ref)) > 1  # not a degenerate repetition
    assert generate(m, prompt, 10, temperature=0) == ref


def test_generation_stops_at_the_context():
    """A context of MAX_LEN tokens predicts one more: MAX_LEN + 1 - len(prompt) new tokens at most."""
    m = make_model("swiglu")
    prompt = tokens(1, 5, seed=7)[0].tolist()
    out = generate(m, prompt, 100, temperature=0)
    assert len(out) == MAX_LEN + 1 - len(prompt)
    assert out == greedy_without_cache(m, prompt, 100)
    assert len(generate(m, tokens(1, MAX_LEN)[0].tolist(), 5, temperature=0)) == 1
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(m, tokens(1, MAX_LEN + 1)[0].tolist(), 5)
    with pytest.raises(ValueError, match="empty"):
        generate(m, [], 5)


def test_top_k_1_is_greedy_and_sampling_is_seeded():
    m = make_model("swiglu", init_std=0.02)  # flat logits: samples vary
    prompt = [1, 2, 3]
    greedy = generate(m, prompt, 15, temperature=0)
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    assert generate(m, prompt, 15, temperature=1.5, top_k=1, generator=g(0)) == greedy
    a = generate(m, prompt, 15, temperature=1.0, generator=g(0))
    assert generate(m, prompt, 15, temperature=1.0, generator=g(0)) == a
    assert generate(m, prompt, 15, temperature=1.0, generator=g(1)) != a
    assert a != greedy
    assert m.training is False


def test_sample_next_top_k_and_temperature():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, 2.8, -1.0])
    g = torch.Generator().manual_seed(0)
    draws = [sample_next(logits, 1.0, top_k=3, generator=g) for _ in range(300)]
    assert set(draws) == {1, 3, 4}
    assert sample_next(logits, 0.0) == 1
    cold = [sample_next(logits, 0.001, generator=g) for _ in range(50)]
    assert set(cold) == {1}


def test_eos_stops_generation():
    m = make_model("swiglu")
    prompt = tokens(1, 4, seed=2)[0].tolist()
    free = generate(m, prompt, 12, temperature=0)
    eos = free[3]
    out = generate(m, prompt, 12, temperature=0, eos_id=eos)
    assert out == free[:free.index(eos) + 1] and len(out) < len(free)


def test_generate_restores_training_mode():
    m = make_model("swiglu").train()
    generate(m, [1, 2], 2, temperature=0)
    assert m.training


# ---------------------------------------------------------------- scripts/sample.py

def train_run(tmp: Path) -> Path:
    """A real 8-step srelu24 run: checkpoints at step 4 (dense warmup) and 8 (2:4 on)."""
    corpus = write_corpus(tmp / "corpus", n_files=20)
    r = run_train(tiny_overrides(tmp, corpus, ["ffn=srelu24", "ffn.dense_warmup_steps=6", "ffn.hidden_dim=128"]))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


@background
def launches(ctx):
    """The run and the command-line checks (helpers.background), run while the in-process tests
    run; the checks that sample the run wait for it."""
    tmp, errors = ctx.tmp("gen"), ctx.tmp("errors")
    jobs = {"run": lambda: train_run(tmp),
            "test_sample_cli_errors": lambda: check_sample_cli_errors(ctx.futures["run"], errors),
            "test_sample_cli": lambda: check_sample_cli(ctx.futures["run"].result())}
    return jobs, {"run": ["test_sample_cli", "test_sample_cli_errors"]}


def tokenizer_of(run_dir):
    return os.path.join(json.loads((run_dir / "run_info.json").read_text())["shard_dir"], "tokenizer.json")


def sample(*args) -> subprocess.CompletedProcess:
    env = {**BASE_ENV, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sample.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_sample_cli(launched):
    launched["test_sample_cli"].result()


def check_sample_cli(run_dir):
    ckpts = run_dir / "checkpoints"
    prompt = "def function_3_4(value"
    r = sample(ckpts / "step_00000008", prompt, "--temperature", 0, "--max-new-tokens", 24)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(prompt) and len(r.stdout.strip()) > len(prompt) + 5
    assert "2:4 sparsity on (step 8 >= ffn.dense_warmup_steps=6)" in r.stderr

    r = sample(ckpts / "step_00000004", "", "--seed", 3, "--top-k", 20, "--num-samples", 2,
               "--max-new-tokens", 16, "--tokenizer", tokenizer_of(run_dir))
    assert r.returncode == 0, r.stderr
    assert "dense, 2:4 off (step 4 < ffn.dense_warmup_steps=6)" in r.stderr
    assert r.stdout.count("--- sample ") == 2


@pytest.mark.slow
def test_sample_cli_errors(launched):
    launched["test_sample_cli_errors"].result()


def check_sample_cli_errors(run: Future, tmp_path):
    r = sample(tmp_path / "nope.pt", "x")  # before the run is done
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: checkpoint") and "nope.pt" in r.stderr
    run_dir = run.result()
    r = sample(run_dir / "checkpoints" / "step_00000008", "x", "--tokenizer", tmp_path / "tok.json")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:") and "tok.json" in r.stderr
