"""scripts/export_hf.py and training/export.py: a swiglu checkpoint of a real tiny run exports as a
Hugging Face LlamaForCausalLM, srelu and srelu24 as ArceeForCausalLM, with our logits (srelu24: the
dense ones; load_exported gives 2:4 back bit-exact) and the same tokenizer; tied embeddings, bf16,
the validation loss 2:4 vs dense, and the one-line errors."""
import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data.tokenizer import EOT, load_tokenizer
from helpers import BASE_ENV, ROOT, background, prepare_shared_cache, run_train, tiny_overrides, write_corpus
from model import FFNConfig, ModelConfig, Transformer
from model.ffn import SReLU24
from training.checkpoint import load_checkpoint, model_shape, save_checkpoint
from training.export import ExportError, export_checkpoint, from_hf_name, load_exported, model_from_checkpoint, to_hf_name
from training.export import SPARSITY_NOTE, val_loss_2to4_and_dense

pytestmark = pytest.mark.filterwarnings("ignore:srelu24. using the pure-PyTorch")

SCRIPT = ROOT / "scripts" / "export_hf.py"
TEXT = 'def add(value, other=3):\n    """Return value."""\n    return value + other  # ünïcode\n' + EOT + "import os\n"


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def tokens(V, B=2, S=40, seed=0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def script_main(argv):
    """scripts/export_hf.py's main() in this process (a subprocess per call would import torch each time)."""
    spec = importlib.util.spec_from_file_location("export_hf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([str(a) for a in argv])


# ---------------------------------------------------------------- real tiny runs, one per FFN kind


def train_run(tmp: Path, corpus: Path, cache: Path, extra: list[str]) -> Path:
    args = [a if not a.startswith("data.cache_dir=") else f"data.cache_dir={cache}" for a in tiny_overrides(tmp, corpus)]
    r = run_train(args + ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.ckpt_every=4", *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = sorted((tmp / "run" / "checkpoints").glob("step_*"))
    assert ckpts
    return ckpts[-1]


@background
def launches(ctx):
    """The runs and the command-line export (helpers.background), on a corpus of 20 files and a
    shard cache prepared before they start."""
    corpus = write_corpus(ctx.tmp("corpus"), n_files=20)
    cache = prepare_shared_cache(ctx.factory, corpus)
    swiglu, srelu24, out = (ctx.tmp(name) for name in ("swiglu", "srelu24", "exports"))
    jobs = {  # GQA and non-default RoPE theta / norm eps, so that their mapping onto LlamaConfig is tested
        "swiglu_ckpt": lambda: train_run(swiglu, corpus, cache, ["ffn=swiglu", "model.n_kv_heads=1",
                                                                 "model.rope_theta=5000.0", "model.norm_eps=1e-6"]),
        "srelu24_ckpt": lambda: train_run(srelu24, corpus, cache,  # GQA as for swiglu
                                          ["ffn=srelu24", "ffn.hidden_dim=128", "ffn.dense_warmup_steps=2",
                                           "model.n_kv_heads=1"]),
        "swiglu_export": lambda: export_swiglu(out / "swiglu", ctx.futures["swiglu_ckpt"].result())}
    return jobs, {"swiglu_ckpt": ["swiglu_export"]}  # the fixtures of these names read them


@pytest.fixture(scope="module")
def swiglu_ckpt(launched):
    return launched["swiglu_ckpt"].result()


@pytest.fixture(scope="module")
def srelu24_ckpt(launched):
    return launched["srelu24_ckpt"].result()


@pytest.fixture(scope="module")
def swiglu_export(launched):
    return launched["swiglu_export"].result()


def export_swiglu(out: Path, swiglu_ckpt: Path) -> Path:
    """The swiglu export through the real command line, in a subprocess."""
    r = subprocess.run([sys.executable, str(SCRIPT), str(swiglu_ckpt), str(out)], capture_output=True, text=True,
                       timeout=120, env=BASE_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LlamaForCausalLM" in r.stdout and "warning" not in r.stderr
    return out


# ---------------------------------------------------------------- swiglu -> Hugging Face Llama


def test_swiglu_export_files_and_config(swiglu_export, swiglu_ckpt):
    assert sorted(p.name for p in swiglu_export.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    c = json.loads((swiglu_export / "config.json").read_text())
    ours = model_from_checkpoint(swiglu_ckpt)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (64, 2, 2, 1)
    assert c["intermediate_size"] == ours.layers[0].feed_forward.w1.weight.shape[0]
    assert c["vocab_size"] == ours.vocab_size == 512 and c["max_position_embeddings"] == 64
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0} and c["rms_norm_eps"] == 1e-6
    assert c["tie_word_embeddings"] is False and c["attention_bias"] is False and c["mlp_bias"] is False
    assert c["dtype"] == "float32" and c["hidden_act"] == "silu" and "sparsity_2to4" not in c
    assert c["exported_from"]["step"] == load_checkpoint(swiglu_ckpt)["step"]
    assert c["eos_token_id"] == load_tokenizer(swiglu_export / "tokenizer.json").token_to_id(EOT)
    weights = load_file(str(swiglu_export / "model.safetensors"))
    assert set(weights) == {to_hf_name(n) for n in ours.state_dict()}
    assert all(t.dtype == torch.float32 for t in weights.values())
    for n, p in ours.state_dict().items():
        assert torch.equal(weights[to_hf_name(n)], p), n


def test_swiglu_export_loads_as_hf_llama_with_our_logits(swiglu_export, swiglu_ckpt):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.LlamaForCausalLM.from_pretrained(swiglu_export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf = hf.float().eval()
    assert hf.config.rope_parameters["rope_theta"] == 5000.0 if hasattr(hf.config, "rope_parameters") \
        else hf.config.rope_theta == 5000.0
    ours = model_from_checkpoint(swiglu_ckpt)
    x = tokens(ours.vocab_size)
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x)
    assert got.shape == ref.shape == (2, 40, 512)
    assert rel_err(got, ref) < 1e-5
    with torch.no_grad():  # and a trained model, not a constant: different inputs, different logits
        assert rel_err(ours(tokens(ours.vocab_size, seed=1)), ref) > 1e-2


def test_swiglu_export_tokenizer_encodes_like_ours(swiglu_export, swiglu_ckpt):
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(Path(json.loads((swiglu_ckpt.parent.parent / "run_info.json").read_text())["shard_dir"])
                          / "tokenizer.json")
    hf = transformers.AutoTokenizer.from_pretrained(swiglu_export)
    want = ours.encode(TEXT).ids
    assert len(want) > 10 and ours.token_to_id(EOT) in want
    assert hf(TEXT)["input_ids"] == want  # no BOS/EOS added
    assert hf.eos_token == EOT and hf.eos_token_id == ours.token_to_id(EOT)
    assert hf.decode(ours.encode("return value + 1").ids) == "return value + 1"


def test_load_exported_reads_swiglu_exports_back(swiglu_export, swiglu_ckpt):
    ours, back = model_from_checkpoint(swiglu_ckpt), load_exported(swiglu_export)
    assert back.cfg.n_kv_heads == 1 and back.cfg.rope_theta == 5000.0 and back.cfg.norm_eps == 1e-6
    x = tokens(ours.vocab_size)
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))


def test_hf_names_round_trip():
    m = Transformer(ModelConfig(dim=32, n_layers=3, n_heads=2, swiglu_hidden=64, max_seq_len=16), FFNConfig(), 50)
    names = list(m.state_dict())
    assert [from_hf_name(to_hf_name(n)) for n in names] == names
    assert to_hf_name("layers.2.feed_forward.w3.weight") == "model.layers.2.mlp.up_proj.weight"
    with pytest.raises(ExportError):
        from_hf_name("model.layers.0.mlp.gate_proj.bias")


# ---------------------------------------------------------------- srelu24 -> Hugging Face Arcee


def test_arcee_names_round_trip():
    m = Transformer(ModelConfig(dim=32, n_layers=3, n_heads=2, swiglu_hidden=64, max_seq_len=16),
                    FFNConfig(kind="srelu"), 50)
    names = list(m.state_dict())
    assert [from_hf_name(to_hf_name(n, "srelu"), "srelu") for n in names] == names
    assert to_hf_name("layers.2.feed_forward.w1.weight", "srelu24") == "model.layers.2.mlp.up_proj.weight"
    assert to_hf_name("layers.2.feed_forward.w2.weight", "srelu") == "model.layers.2.mlp.down_proj.weight"
    with pytest.raises(ExportError):
        from_hf_name("model.layers.0.mlp.gate_proj.weight", "srelu")  # Arcee's MLP has no gate


@pytest.fixture(scope="module")
def srelu24_export(tmp_path_factory, srelu24_ckpt):
    out = tmp_path_factory.mktemp("exports") / "srelu24"
    assert script_main([srelu24_ckpt, out]) == 0
    return out


def test_srelu24_export_is_an_arcee_model_with_a_2to4_note(srelu24_export, srelu24_ckpt):
    out = srelu24_export
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    c = json.loads((out / "config.json").read_text())
    state = load_checkpoint(srelu24_ckpt)
    assert c["architectures"] == ["ArceeForCausalLM"] and c["model_type"] == "arcee" and c["hidden_act"] == "relu2"
    assert (c["intermediate_size"], c["num_key_value_heads"], c["vocab_size"]) == (128, 1, 512)
    assert c["sparsity_2to4"]["trained_with_2to4"] is True and c["sparsity_2to4"]["from_step"] == 2
    assert c["sparsity_2to4"]["transformers_forward"] == "dense" and c["sparsity_2to4"]["note"] == SPARSITY_NOTE
    assert c["exported_from"]["model"] == state["config"]["model"] and c["exported_from"]["ffn"] == state["config"]["ffn"]
    assert c["exported_from"]["step"] == state["step"] and c["dtype"] == "float32"
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == {to_hf_name(n, "srelu24") for n in state["model"]}
    assert "model.layers.0.mlp.up_proj.weight" in weights and not any("gate_proj" in n for n in weights)


def test_srelu24_export_loads_in_transformers_with_our_dense_logits(srelu24_export, srelu24_ckpt):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(srelu24_export, output_loading_info=True)
    assert type(hf).__name__ == "ArceeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = model_from_checkpoint(srelu24_ckpt)  # 2:4 off: the dense Squared-ReLU function
    x = tokens(ours.vocab_size)
    with torch.no_grad():
        ref, got = hf.float().eval()(x).logits, ours(x)
        assert got.shape == ref.shape == (2, 40, 512)
        assert rel_err(got, ref) < 1e-5
        ours.set_2to4(True)
        assert rel_err(ours(x), ref) > 1e-4  # what transformers computes is not the 2:4 function


def test_srelu24_export_round_trips_bit_exact_in_2to4_mode(srelu24_export, srelu24_ckpt):
    orig, back = model_from_checkpoint(srelu24_ckpt), load_exported(srelu24_export)
    assert all(m.sparse for m in back.modules() if isinstance(m, SReLU24))  # 2:4 on by default
    assert back.ffn_cfg == orig.ffn_cfg and back.cfg == orig.cfg  # the recipe and the run's names come back
    assert (back.ffn_cfg.dense_warmup_steps, back.ffn_cfg.kind) == (2, "srelu24") and back.cfg.n_kv_heads == 1
    x = tokens(orig.vocab_size)
    with torch.no_grad():
        dense = orig(x)
        orig.set_2to4(True)
        sparse = orig(x)
        assert torch.equal(back(x), sparse)
        assert not torch.equal(sparse, dense)  # 2:4 mode is a different function: the flag matters
        back.set_2to4(False)
        assert torch.equal(back(x), dense)


def test_val_loss_2to4_against_dense(tmp_path, srelu24_ckpt):
    model, state = model_from_checkpoint(srelu24_ckpt), load_checkpoint(srelu24_ckpt)
    got = val_loss_2to4_and_dense(model, state, srelu24_ckpt, n_batches=2)
    assert got["val_windows"] == 2 * state["config"]["trainer"]["micro_batch_size"]
    assert got["val_loss_2to4"] != got["val_loss_dense"] and 0 < got["val_loss_dense"] < 10
    from data.loader import TokenLoader
    from data.shards import load_manifest
    from training.export import run_shard_dir

    shards, t = run_shard_dir(srelu24_ckpt, "manifest.json"), state["config"]["trainer"]
    batches = TokenLoader(shards, load_manifest(shards), "val", t["seq_len"], t["micro_batch_size"], t["seed"]) \
        .fixed_batches(2)
    with torch.no_grad():  # each is the model's own mean loss over those windows, in that mode
        for key, on in (("val_loss_dense", False), ("val_loss_2to4", True)):
            model.set_2to4(on)
            assert got[key] == pytest.approx(torch.stack([model(x, y) for x, y in batches]).mean().item(), rel=1e-6)
    out = tmp_path / "measured"
    assert script_main([srelu24_ckpt, out, "--val-batches", "2"]) == 0
    assert json.loads((out / "config.json").read_text())["sparsity_2to4"]["val_loss_2to4"] == \
        pytest.approx(got["val_loss_2to4"], rel=1e-6)


def test_bf16_export(tmp_path, srelu24_ckpt):
    out = tmp_path / "bf16"
    assert script_main([srelu24_ckpt, out, "--dtype", "bf16"]) == 0
    weights = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    orig = model_from_checkpoint(srelu24_ckpt)
    for n, p in orig.state_dict().items():
        assert torch.equal(weights[to_hf_name(n, "srelu24")], p.to(torch.bfloat16)), n
    back = load_exported(out)
    assert back.tok_embeddings.weight.dtype == torch.float32
    orig.set_2to4(True)
    x = tokens(orig.vocab_size)
    with torch.no_grad():
        assert 0 < rel_err(back(x), orig(x)) < 3e-2


# ---------------------------------------------------------------- tied embeddings (synthetic checkpoints)


def synthetic_checkpoint(run_dir: Path, kind: str, vocab=97) -> tuple[Path, Transformer]:
    mcfg = ModelConfig(name="t", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, swiglu_hidden=64, max_seq_len=32,
                       tie_embeddings=True)
    fcfg = FFNConfig(kind=kind, hidden_dim=64, kernels=False)
    torch.manual_seed(0)
    model = Transformer(mcfg, fcfg, vocab).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape))
    config = {"model": asdict(mcfg), "ffn": asdict(fcfg)}
    path = save_checkpoint(run_dir, 3, {"model": model.state_dict(), "model_shape": model_shape(model),
                                        "config": config})
    return path, model


@pytest.mark.parametrize("kind", ["swiglu", "srelu", "srelu24"])
def test_tied_embeddings(tmp_path, kind):
    ckpt, model = synthetic_checkpoint(tmp_path / "run", kind)
    info = export_checkpoint(ckpt, tmp_path / "out")
    assert info["tokenizer"] is None and "not found" in info["tokenizer_note"]  # no run_info.json: weights only
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "lm_head.weight" not in weights and "output.weight" not in weights
    x = tokens(97, S=20)
    with torch.no_grad():
        want = model(x)  # srelu24: dense, as transformers computes it
        back = load_exported(tmp_path / "out")
        assert back.output.weight is back.tok_embeddings.weight
        model.set_2to4(True)
        assert torch.equal(back(x), model(x))  # srelu24: 2:4 on
        back.set_2to4(False)
        assert torch.equal(back(x), want)
        transformers = pytest.importorskip("transformers")  # GQA (4 heads over 2) and tied embeddings
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
        assert type(hf).__name__ == ("LlamaForCausalLM" if kind == "swiglu" else "ArceeForCausalLM")
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert hf.config.tie_word_embeddings and hf.config.eos_token_id is None
        assert hf.config.num_key_value_heads == 2 and hf.config.num_attention_heads == 4
        assert rel_err(hf.float().eval()(x).logits, want) < 1e-5


# ---------------------------------------------------------------- errors: one line, exit 2


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_missing_checkpoint(tmp_path, capsys):
    assert script_main([tmp_path / "nope.pt", tmp_path / "out"]) == 2
    assert "does not exist" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_unreadable_checkpoint(tmp_path, capsys):
    ckpt, _ = synthetic_checkpoint(tmp_path / "run", "srelu")
    (ckpt / "manifest.json").unlink()  # so that the damage below is found by reading, not by sha256
    (ckpt / ".metadata").write_bytes(b"not a checkpoint")
    assert script_main([ckpt, tmp_path / "out"]) == 2
    assert "cannot read checkpoint" in one_error_line(capsys)
    (ckpt / "train_state.json").write_text('{"something": 1}')
    assert script_main([ckpt, tmp_path / "out"]) == 2
    assert "not a checkpoint" in one_error_line(capsys)
    bad = tmp_path / "step_00000001.pt"  # a file: the single-file format of older versions
    bad.write_bytes(b"not a checkpoint")
    assert script_main([bad, tmp_path / "out"]) == 2
    assert "not a checkpoint" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_non_empty_out_dir_needs_force(tmp_path, capsys):
    ckpt, model = synthetic_checkpoint(tmp_path / "run", "srelu")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert script_main([ckpt, out]) == 2
    err = one_error_line(capsys)
    assert "not empty" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert script_main([ckpt, out, "--force"]) == 0
    assert (out / "notes.txt").read_text() == "keep me"
    assert torch.equal(load_exported(out).output.weight, model.output.weight)
    (out / "model.safetensors").write_bytes(b"stale")  # --force replaces an earlier export
    assert script_main([ckpt, out, "--force"]) == 0
    load_exported(out)
    capsys.readouterr()
    assert script_main([ckpt, out / "notes.txt"]) == 2  # a file, not a directory
    assert "not a directory" in one_error_line(capsys)


def test_load_exported_errors(tmp_path):
    with pytest.raises(ExportError, match="not an export directory"):
        load_exported(tmp_path)
    ckpt, _ = synthetic_checkpoint(tmp_path / "run", "srelu")
    export_checkpoint(ckpt, tmp_path / "out")
    (tmp_path / "out" / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(ExportError, match="cannot read"):
        load_exported(tmp_path / "out")


def test_explicit_tokenizer_must_match_the_checkpoint(tmp_path, capsys, swiglu_export):
    tok = swiglu_export / "tokenizer.json"
    ckpt, _ = synthetic_checkpoint(tmp_path / "run", "swiglu")
    state = load_checkpoint(ckpt)
    resave = lambda: save_checkpoint(tmp_path / "run", 3, {k: v for k, v in state.items()  # noqa: E731
                                                           if k not in ("format", "step", "world_size")})
    state["data"] = {"tokenizer_sha256": "0" * 64, "vocab_size": 97}
    resave()
    assert script_main([ckpt, tmp_path / "out", "--tokenizer", tok]) == 2
    assert "is not the one the checkpoint was trained with" in one_error_line(capsys)
    assert script_main([ckpt, tmp_path / "out", "--tokenizer", tmp_path / "missing.json"]) == 2
    assert "does not exist" in one_error_line(capsys)
    state["data"]["tokenizer_sha256"] = None
    resave()  # no recorded hash: any readable tokenizer is taken
    assert script_main([ckpt, tmp_path / "out", "--tokenizer", tok]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok.read_bytes()
