"""Export a training checkpoint as a self-contained model directory (scripts/export_hf.py).

What OUT_DIR holds depends on the FFN:

ffn=swiglu: a Hugging Face `LlamaForCausalLM` (the model is numerically Llama, see
model/transformer.py), loadable with `LlamaForCausalLM.from_pretrained(OUT_DIR)`:
- `config.json`: the LlamaConfig, written by hand so that export needs no `transformers`.
  It is meant for transformers 4.45+ and 5.x alike (tested with 5.x): `rope_theta` is written both top-level
  (4.x) and in `rope_parameters` (5.x), the dtype both as `torch_dtype` (4.x) and `dtype` (5.x).
  `eos_token_id` is the tokenizer's `<|endoftext|>` id when the tokenizer is known, else null;
  `bos_token_id` is null (our data has no BOS token).
- `model.safetensors`: the weights under HF's names (`HF_NAMES`); with tied embeddings only
  `model.embed_tokens.weight` is stored (HF ties `lm_head` to it, as its own save does).

ffn=srelu / srelu24 (not Llama: a two-matrix Squared-ReLU FFN): our own format, loaded with
`training.export.load_exported(OUT_DIR)`, which returns a `model.Transformer`:
- `sparse24_config.json`: {"format": "sparse24", "version": 1, "model": {...}, "ffn": {...},
  "vocab_size": V, "sparse24_active": bool, "dtype": "float32" | "bfloat16",
  "source": {"checkpoint", "step", "tokenizer_sha256"}}. `model` and `ffn` are the resolved
  config groups of the run, as the checkpoint holds them.
- `model.safetensors`: the weights under our parameter names (`Transformer.state_dict()`);
  with tied embeddings `output.weight` is left out.
`sparse24_active` is true for srelu24: a trained srelu24 model is used in its 2:4 mode, so
`load_exported` switches 2:4 on (`model.set_2to4(True)`); call `set_2to4(False)` for
the dense Squared-ReLU function. It is false for srelu (where set_2to4 is a no-op).

Both: `tokenizer.json` (copied from the run's shard directory, found through the checkpoint's
run directory: run_info.json -> shard_dir, and checked against the checkpoint's tokenizer
hash) and a minimal `tokenizer_config.json` (PreTrainedTokenizerFast, eos `<|endoftext|>`), so
`AutoTokenizer.from_pretrained(OUT_DIR)` works. Without a tokenizer the weights still export.

Weights are fp32 by default; dtype="bf16" stores bfloat16 (load_exported upcasts to fp32).
`load_exported` also reads swiglu exports (config.json + HF names) back into our Transformer.
"""
import json
import os
import re
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Optional

import torch

from data.errors import DataError
from data.tokenizer import EOT, load_tokenizer, tokenizer_sha256
from model import FFNConfig, ModelConfig, Transformer, ffn_hidden_dim
from model.transformer import HF_NAMES

from .checkpoint import is_checkpoint, list_checkpoints, load_checkpoint
from .errors import CheckpointError

FORMAT_NAME, FORMAT_VERSION = "sparse24", 1
WEIGHTS, HF_CONFIG, OUR_CONFIG = "model.safetensors", "config.json", "sparse24_config.json"
TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
EXPORT_FILES = (WEIGHTS, HF_CONFIG, OUR_CONFIG, TOKENIZER, TOKENIZER_CONFIG)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class ExportError(Exception):
    """One-line user-facing message: what cannot be exported or written, and why."""


# ---------------------------------------------------------------- names


def _template(name: str) -> tuple[str, Optional[str]]:
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    return ("layers.{i}." + m.group(2), m.group(1)) if m else (name, None)


def to_hf_name(name: str) -> str:
    template, i = _template(name)
    if template not in HF_NAMES:
        raise ExportError(f"parameter {name} has no Hugging Face Llama name (HF_NAMES)")
    return HF_NAMES[template].format(i=i)


_FROM_HF = [(re.compile("^" + re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$"), ours) for ours, hf in HF_NAMES.items()]


def from_hf_name(name: str) -> str:
    for pattern, ours in _FROM_HF:
        m = pattern.match(name)
        if m:
            return ours.format(i=m.group(1)) if m.groups() else ours
    raise ExportError(f"{name} is not a LlamaForCausalLM parameter this model has")


# ---------------------------------------------------------------- checkpoint -> model


def _dataclass_from(cls, d: dict):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory (checkpoints/step_XXXXXXXX), or a run directory (its newest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"checkpoint {path} does not exist")
    if is_checkpoint(path) or not path.is_dir():
        return path
    found = list_checkpoints(path)
    if not found:
        raise ExportError(f"{path} is neither a checkpoint nor a run directory with checkpoints "
                          f"(expected {path}/checkpoints/step_XXXXXXXX/)")
    return found[0]


def configs_of(state: dict, path: Path = Path("checkpoint")) -> tuple[ModelConfig, FFNConfig, int]:
    """The model/ffn configs and vocabulary size a checkpoint was trained with."""
    cfg = state.get("config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("ffn"), dict):
        raise ExportError(f"{path} holds no resolved model/ffn config (a checkpoint of an older trainer?)")
    try:
        mcfg = _dataclass_from(ModelConfig, cfg["model"])
        fcfg = _dataclass_from(FFNConfig, cfg["ffn"])
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: unusable model/ffn config: {e}") from e
    emb = state["model"].get("tok_embeddings.weight")
    vocab = state.get("model_shape", {}).get("vocab_size") or (emb.shape[0] if emb is not None else None)
    if not vocab:
        raise ExportError(f"{path}: cannot tell the vocabulary size")
    return mcfg, fcfg, int(vocab)


def check_weights(state_dict: dict, mcfg: ModelConfig, fcfg: FFNConfig, vocab: int, path) -> None:
    """The weights are exactly those of the model the config builds (checked on the meta device)."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Transformer(mcfg, fcfg, vocab).state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state_dict.items()}
    if want != have:
        diff = sorted(set(want) ^ set(have)) or [k for k in want if want[k] != have[k]]
        raise ExportError(f"{path}: the weights do not fit the config's model (first differences: {diff[:3]})")


def model_from_checkpoint(path: Path) -> Transformer:
    """Our model with a checkpoint's weights, in eval mode (2:4 off, as Transformer builds it)."""
    path = resolve_checkpoint(path)
    state = load_checkpoint(path)
    mcfg, fcfg, vocab = configs_of(state, path)
    model = Transformer(mcfg, fcfg, vocab)
    model.load_state_dict(state["model"])
    return model.eval()


# ---------------------------------------------------------------- tokenizer


def find_tokenizer(checkpoint: Path) -> Optional[Path]:
    """tokenizer.json of the run's shard directory: <run>/checkpoints/step_XXXXXXXX -> <run>/run_info.json."""
    run_dir = Path(checkpoint).resolve().parent.parent
    try:
        shard_dir = json.loads((run_dir / "run_info.json").read_text())["shard_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    shard_dir = Path(shard_dir)
    candidates = [shard_dir] if shard_dir.is_absolute() else [run_dir / shard_dir, Path.cwd() / shard_dir,
                                                              Path(__file__).resolve().parent.parent / shard_dir]
    for d in candidates:
        if (d / TOKENIZER).is_file():
            return d / TOKENIZER
    return None


def tokenizer_config(max_len: int, has_eot: bool) -> dict:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    if has_eot:
        cfg["eos_token"] = EOT
    return cfg


# ---------------------------------------------------------------- configs


def llama_config(mcfg: ModelConfig, hidden: int, vocab: int, dtype: torch.dtype, eos_id: Optional[int]) -> dict:
    dtype_name = DTYPE_NAMES[dtype]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": mcfg.dim, "intermediate_size": hidden, "num_hidden_layers": mcfg.n_layers,
        "num_attention_heads": mcfg.n_heads, "num_key_value_heads": mcfg.n_kv_heads or mcfg.n_heads,
        "head_dim": mcfg.dim // mcfg.n_heads, "hidden_act": "silu", "rms_norm_eps": mcfg.norm_eps,
        "rope_theta": mcfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
        "vocab_size": vocab, "max_position_embeddings": mcfg.max_seq_len,
        "tie_word_embeddings": mcfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "initializer_range": mcfg.init_std, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None,
        "torch_dtype": dtype_name, "dtype": dtype_name,
    }


# ---------------------------------------------------------------- export


def check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"output directory {out_dir} exists and is not empty; choose another or pass --force")


def _umask_mode(path: Path) -> None:
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype: str = "fp32", force: bool = False,
                      tokenizer: Optional[Path] = None) -> dict:
    """Write the export of `checkpoint` (a file or a run directory) to `out_dir`. Returns a
    summary: kind, format ("llama" | "sparse24"), checkpoint, step, files, tokenizer (path or None),
    tokenizer_note (why there is none). `tokenizer`: a tokenizer.json to use instead of the run's.
    With force, an existing out_dir is reused: earlier export files in it are replaced, nothing else is touched."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    out_dir = Path(out_dir)
    check_out_dir(out_dir, force)
    path = resolve_checkpoint(checkpoint)
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:  # torch's unpickling messages run over several lines: keep the first
        raise ExportError(str(e).strip().splitlines()[0]) from e
    mcfg, fcfg, vocab = configs_of(state, path)
    check_weights(state["model"], mcfg, fcfg, vocab, path)

    # the tokenizer: given, or the run's; it must be the one the checkpoint was trained on
    want_sha = state.get("data", {}).get("tokenizer_sha256")
    tok_path, tok, note = (Path(tokenizer) if tokenizer else find_tokenizer(path)), None, None
    if tok_path is None:
        note = "the run's tokenizer.json was not found (run_info.json -> shard_dir); pass --tokenizer"
    else:
        try:
            tok = load_tokenizer(tok_path)
        except DataError as e:
            if tokenizer:
                raise ExportError(str(e)) from e
            tok, note = None, str(e)
        if tok is not None and want_sha and tokenizer_sha256(tok) != want_sha:
            msg = (f"tokenizer {tok_path} (sha256 {tokenizer_sha256(tok)[:12]}) is not the one the checkpoint "
                   f"was trained with ({want_sha[:12]})")
            if tokenizer:
                raise ExportError(msg)
            tok, note = None, msg
    eos_id = tok.token_to_id(EOT) if tok is not None else None

    tied = mcfg.tie_embeddings
    is_llama = fcfg.kind == "swiglu"
    tensors = {}
    for name, t in state["model"].items():
        if tied and name == "output.weight":
            continue  # shares tok_embeddings.weight; safetensors stores no aliases
        tensors[to_hf_name(name) if is_llama else name] = t.detach().to(torch_dtype).contiguous()

    try:
        files = _write(out_dir, state, tensors, mcfg, fcfg, vocab, torch_dtype, tok, tok_path, eos_id, path, want_sha)
    except OSError as e:
        raise ExportError(f"cannot write {out_dir}: {e}") from e
    return {"kind": fcfg.kind, "format": "llama" if is_llama else FORMAT_NAME, "checkpoint": str(path),
            "step": state.get("step"), "dtype": DTYPE_NAMES[torch_dtype], "files": files,
            "tokenizer": str(tok_path) if tok is not None else None, "tokenizer_note": note}


def _write(out_dir, state, tensors, mcfg, fcfg, vocab, torch_dtype, tok, tok_path, eos_id, path, want_sha) -> list:
    from safetensors.torch import save_file

    is_llama = fcfg.kind == "swiglu"
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in EXPORT_FILES:  # only reached with force (or an empty dir): drop an earlier export's files
        (out_dir / stale).unlink(missing_ok=True)
    files = [WEIGHTS]
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    _umask_mode(out_dir / WEIGHTS)  # safetensors writes it 0600
    if is_llama:
        _write_json(out_dir / HF_CONFIG, llama_config(mcfg, ffn_hidden_dim(mcfg, fcfg), vocab, torch_dtype, eos_id))
        files.append(HF_CONFIG)
    else:
        _write_json(out_dir / OUR_CONFIG, {
            "format": FORMAT_NAME, "version": FORMAT_VERSION,
            "model": state["config"]["model"], "ffn": state["config"]["ffn"], "vocab_size": vocab,
            "sparse24_active": fcfg.kind == "srelu24", "dtype": DTYPE_NAMES[torch_dtype],
            "source": {"checkpoint": str(path.resolve()), "step": state.get("step"), "tokenizer_sha256": want_sha}})
        files.append(OUR_CONFIG)
    if tok is not None:
        shutil.copyfile(tok_path, out_dir / TOKENIZER)
        _write_json(out_dir / TOKENIZER_CONFIG, tokenizer_config(mcfg.max_seq_len, eos_id is not None))
        files += [TOKENIZER, TOKENIZER_CONFIG]
    return files


# ---------------------------------------------------------------- load back


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {path}: {e}") from e


def _config_from_llama(c: dict) -> tuple[ModelConfig, FFNConfig, int]:
    if c.get("model_type") != "llama":
        raise ExportError(f"config.json has model_type={c.get('model_type')!r}, expected 'llama'")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ExportError(f"config.json uses RoPE scaling {rope}; this model has plain RoPE")
    unsupported = {k: c.get(k) for k in ("attention_bias", "mlp_bias") if c.get(k)}
    if c.get("hidden_act", "silu") != "silu":
        unsupported["hidden_act"] = c["hidden_act"]
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, dim // heads):
        unsupported["head_dim"] = c["head_dim"]
    if unsupported:
        raise ExportError(f"config.json has settings this model does not support: {unsupported}")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    mcfg = ModelConfig(name="llama", dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=c.get("num_key_value_heads") or heads, swiglu_hidden=c["intermediate_size"],
                       max_seq_len=c["max_position_embeddings"], rope_theta=float(theta),
                       norm_eps=c["rms_norm_eps"], tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                       init_std=c.get("initializer_range", 0.02))
    return mcfg, FFNConfig(kind="swiglu"), c["vocab_size"]


def load_exported(out_dir: Path) -> Transformer:
    """Our Transformer from an export directory (either format), in fp32 and eval mode; an
    srelu24 export comes back with 2:4 on (its `sparse24_active`)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    if (out_dir / OUR_CONFIG).is_file():
        c = _read_json(out_dir / OUR_CONFIG)
        if c.get("format") != FORMAT_NAME or c.get("version") != FORMAT_VERSION:
            raise ExportError(f"{out_dir / OUR_CONFIG} is not a {FORMAT_NAME} v{FORMAT_VERSION} export config")
        mcfg = _dataclass_from(ModelConfig, c["model"])
        fcfg = _dataclass_from(FFNConfig, c["ffn"])
        vocab, rename, sparse = c["vocab_size"], (lambda n: n), bool(c.get("sparse24_active", False))
    elif (out_dir / HF_CONFIG).is_file():
        mcfg, fcfg, vocab = _config_from_llama(_read_json(out_dir / HF_CONFIG))
        rename, sparse = from_hf_name, False
    else:
        raise ExportError(f"{out_dir} holds neither {OUR_CONFIG} nor {HF_CONFIG}: not an export directory")
    try:
        weights = load_file(str(out_dir / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - missing file or a damaged header
        raise ExportError(f"cannot read {out_dir / WEIGHTS}: {type(e).__name__}: {e}") from e
    state = {rename(k): v for k, v in weights.items()}
    model = Transformer(mcfg, fcfg, vocab)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise ExportError(f"{out_dir / WEIGHTS} does not fit the config's model: {str(e).splitlines()[-1].strip()}") from e
    allowed_missing = {"output.weight"} if mcfg.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ExportError(f"{out_dir / WEIGHTS} does not fit the config's model: missing "
                          f"{sorted(set(missing) - allowed_missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    model.set_2to4(sparse)
    return model.eval()


__all__ = ["ExportError", "export_checkpoint", "load_exported", "model_from_checkpoint", "find_tokenizer",
           "to_hf_name", "from_hf_name"]
