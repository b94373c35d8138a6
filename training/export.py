"""Export a training checkpoint as a Hugging Face model directory (scripts/export_hf.py).

Every FFN maps onto an architecture that transformers has, so `AutoModelForCausalLM.from_pretrained(OUT_DIR)`
loads the export (and lm-eval `--model hf`, vLLM, ... run it):
- ffn=swiglu: `LlamaForCausalLM` (the model is numerically Llama, see model/transformer.py);
- ffn=srelu and srelu24: `ArceeForCausalLM`, a Llama whose MLP is non-gated Squared-ReLU
  (`down_proj(relu(up_proj(x))^2)`, hidden_act "relu2"): our w1 is its up_proj, w2 its down_proj.

OUT_DIR holds:
- `config.json`: the transformers config class's own (LlamaConfig / ArceeConfig, `save_pretrained`),
  with `eos_token_id` the tokenizer's `<|endoftext|>` id when the tokenizer is known, else null,
  `bos_token_id` null (our data has no BOS token), and two fields of ours:
  - `exported_from`: {"checkpoint", "step", "tokenizer_sha256", "model", "ffn"}: where it came from and
    the run's resolved model/ffn config groups (load_exported rebuilds exactly our model from them);
  - `sparsity_2to4` (srelu24 only): the model was trained with 2:4 activation sparsity (`SPARSITY_NOTE`).
    transformers runs the dense Squared-ReLU FFN with the same weights: it has no 2:4 forward. That is
    a different function from the one trained; `load_exported` gives it with 2:4 on.
- `model.safetensors`: the weights under HF's names (`hf_names`); with tied embeddings only
  `model.embed_tokens.weight` is stored (HF ties `lm_head` to it, as its own save does).
- `tokenizer.json` (copied from the run's shard directory, found through the checkpoint's run
  directory: run_info.json -> shard_dir, and checked against the checkpoint's tokenizer hash) and a
  minimal `tokenizer_config.json` (PreTrainedTokenizerFast, eos `<|endoftext|>`), so
  `AutoTokenizer.from_pretrained(OUT_DIR)` works. Without a tokenizer the weights still export.

Weights are fp32 by default; dtype="bf16" stores bfloat16 (load_exported upcasts to fp32).
A model trained with model.attention=document exports as a causal HF model: the same function on
text holding no <|endoftext|> after its first token (one document), not across documents.
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

WEIGHTS, HF_CONFIG = "model.safetensors", "config.json"
TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
EXPORT_FILES = (WEIGHTS, HF_CONFIG, TOKENIZER, TOKENIZER_CONFIG)
ARCHITECTURES = {"swiglu": ("LlamaForCausalLM", "llama"), "srelu": ("ArceeForCausalLM", "arcee"),
                 "srelu24": ("ArceeForCausalLM", "arcee")}
SPARSITY_NOTE = ("Trained with 2:4 activation sparsity (of every 4 consecutive FFN hidden activations of a token, "
                 "the 2 largest are kept) from step dense_warmup_steps on. transformers' ArceeForCausalLM has no "
                 "2:4 forward: it computes the dense Squared-ReLU FFN with these weights, which is not the function "
                 "that was trained. training.export.load_exported(dir) gives the model with 2:4 on.")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class ExportError(Exception):
    """One-line user-facing message: what cannot be exported or written, and why."""


# ---------------------------------------------------------------- names


def hf_names(kind: str) -> dict:
    """Our parameter names -> transformers' ({i}: layer index). Arcee's MLP is non-gated: w1 is its up_proj."""
    if kind == "swiglu":
        return HF_NAMES
    names = {k: v for k, v in HF_NAMES.items() if ".feed_forward." not in k}
    return {**names, "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.up_proj.weight",
            "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight"}


def _template(name: str) -> tuple[str, Optional[str]]:
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    return ("layers.{i}." + m.group(2), m.group(1)) if m else (name, None)


def to_hf_name(name: str, kind: str = "swiglu") -> str:
    template, i = _template(name)
    names = hf_names(kind)
    if template not in names:
        raise ExportError(f"parameter {name} has no {ARCHITECTURES[kind][0]} name (hf_names)")
    return names[template].format(i=i)


def from_hf_name(name: str, kind: str = "swiglu") -> str:
    for ours, hf in hf_names(kind).items():
        m = re.match("^" + re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$", name)
        if m:
            return ours.format(i=m.group(1)) if m.groups() else ours
    raise ExportError(f"{name} is not a {ARCHITECTURES[kind][0]} parameter this model has")


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
        fcfg = _dataclass_from(FFNConfig, cfg["ffn"])  # an unregistered kind is a ValueError
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


def model_and_state(path: Path) -> tuple[Transformer, dict, Path]:
    """Our model with a checkpoint's weights, in eval mode (2:4 off, as Transformer builds it), the
    checkpoint's state and its resolved path. `path`: a checkpoint or a run directory (its newest)."""
    path = resolve_checkpoint(path)
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:  # torch's unpickling messages run over several lines: keep the first
        raise ExportError(str(e).strip().splitlines()[0]) from e
    mcfg, fcfg, vocab = configs_of(state, path)
    check_weights(state["model"], mcfg, fcfg, vocab, path)
    model = Transformer(mcfg, fcfg, vocab, eot_id=state.get("data", {}).get("eot_id"))
    model.load_state_dict(state["model"])
    return model.eval(), state, path


def model_from_checkpoint(path: Path) -> Transformer:
    """Our model with a checkpoint's weights, in eval mode (2:4 off, as Transformer builds it)."""
    return model_and_state(path)[0]


# ---------------------------------------------------------------- tokenizer


def run_shard_dir(checkpoint: Path, holding: str = TOKENIZER) -> Optional[Path]:
    """The run's shard directory (<run>/checkpoints/step_XXXXXXXX -> <run>/run_info.json -> shard_dir),
    if it holds `holding`; a relative shard_dir is tried from the run, the working and the repo directory."""
    run_dir = Path(checkpoint).resolve().parent.parent
    try:
        shard_dir = json.loads((run_dir / "run_info.json").read_text())["shard_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    shard_dir = Path(shard_dir)
    candidates = [shard_dir] if shard_dir.is_absolute() else [run_dir / shard_dir, Path.cwd() / shard_dir,
                                                              Path(__file__).resolve().parent.parent / shard_dir]
    return next((d for d in candidates if (d / holding).is_file()), None)


def find_tokenizer(checkpoint: Path) -> Optional[Path]:
    """tokenizer.json of the run's shard directory."""
    shard_dir = run_shard_dir(checkpoint)
    return shard_dir / TOKENIZER if shard_dir else None


def checkpoint_tokenizer(checkpoint: Path, state: dict, given: Optional[Path] = None):
    """The tokenizer a checkpoint was trained with: `given` (a tokenizer.json), else the run's.
    Returns (tokenizer or None, its path or None, why there is none). A given tokenizer that cannot
    be read or is not the checkpoint's (its recorded sha256) is an ExportError; the run's is only
    left out, with the reason."""
    want_sha = state.get("data", {}).get("tokenizer_sha256")
    path = Path(given) if given else find_tokenizer(checkpoint)
    if path is None:
        return None, None, "the run's tokenizer.json was not found (run_info.json -> shard_dir); pass --tokenizer"
    try:
        tok = load_tokenizer(path)
    except DataError as e:
        if given:
            raise ExportError(str(e)) from e
        return None, path, str(e)
    if want_sha and tokenizer_sha256(tok) != want_sha:
        msg = (f"tokenizer {path} (sha256 {tokenizer_sha256(tok)[:12]}) is not the one the checkpoint "
               f"was trained with ({want_sha[:12]})")
        if given:
            raise ExportError(msg)
        return None, path, msg
    return tok, path, None


def tokenizer_config(max_len: int, has_eot: bool) -> dict:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    if has_eot:
        cfg["eos_token"] = EOT
    return cfg


# ---------------------------------------------------------------- configs


def hf_config(mcfg: ModelConfig, fcfg: FFNConfig, vocab: int, dtype: torch.dtype, eos_id: Optional[int],
              exported_from: dict):
    """The transformers config (LlamaConfig or ArceeConfig) of our model."""
    import transformers

    arch, model_type = ARCHITECTURES[fcfg.kind]
    cls = transformers.LlamaConfig if model_type == "llama" else transformers.ArceeConfig
    extra = {}
    if fcfg.kind == "srelu24":
        extra["sparsity_2to4"] = {"trained_with_2to4": True, "from_step": fcfg.dense_warmup_steps,
                                  "transformers_forward": "dense", "note": SPARSITY_NOTE}
    cfg = cls(vocab_size=vocab, hidden_size=mcfg.dim, intermediate_size=ffn_hidden_dim(mcfg, fcfg),
              num_hidden_layers=mcfg.n_layers, num_attention_heads=mcfg.n_heads,
              num_key_value_heads=mcfg.n_kv_heads or mcfg.n_heads, head_dim=mcfg.dim // mcfg.n_heads,
              hidden_act="silu" if model_type == "llama" else "relu2", max_position_embeddings=mcfg.max_seq_len,
              initializer_range=mcfg.init_std, rms_norm_eps=mcfg.norm_eps, rope_theta=mcfg.rope_theta,
              tie_word_embeddings=mcfg.tie_embeddings, attention_bias=False, mlp_bias=False,
              bos_token_id=None, eos_token_id=eos_id, pad_token_id=None, dtype=DTYPE_NAMES[dtype],
              exported_from=exported_from, **extra)
    cfg.architectures = [arch]
    return cfg


# ---------------------------------------------------------------- 2:4 against dense


@torch.no_grad()
def val_loss_2to4_and_dense(model: Transformer, state: dict, checkpoint: Path, n_batches: int = 0) -> dict:
    """An srelu24 model's validation loss with 2:4 on (as trained) and off (what transformers
    computes from the export), over the run's validation split in the trainer's windows (its
    seq_len and micro_batch_size; n_batches 0: every window). fp32 on the CPU."""
    from data.loader import TokenLoader
    from data.shards import load_manifest

    shard_dir = run_shard_dir(checkpoint, "manifest.json")
    if shard_dir is None:
        raise ExportError(f"the run's token shards were not found (run_info.json -> shard_dir) for {checkpoint}")
    t = state["config"]["trainer"]
    loader = TokenLoader(shard_dir, load_manifest(shard_dir), "val", t["seq_len"], t["micro_batch_size"], t["seed"])
    batches = loader.fixed_batches(n_batches or loader.n_windows)
    out = {"val_windows": sum(len(x) for x, _ in batches), "seq_len": t["seq_len"]}
    for key, on in (("val_loss_2to4", True), ("val_loss_dense", False)):
        model.set_2to4(on)
        out[key] = float(sum(model(x, y).item() * len(x) for x, y in batches) / out["val_windows"])
    model.set_2to4(False)
    return out


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
                      tokenizer: Optional[Path] = None, val_batches: Optional[int] = None) -> dict:
    """Write the export of `checkpoint` (a checkpoint or a run directory) to `out_dir`. Returns a
    summary: kind, architecture, checkpoint, step, dtype, files, tokenizer (path or None),
    tokenizer_note (why there is none). `tokenizer`: a tokenizer.json to use instead of the run's.
    With force, an existing out_dir is reused: earlier export files in it are replaced, nothing else is touched.
    val_batches (srelu24; 0: all): measure val_loss_2to4_and_dense first and record it in `sparsity_2to4`."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    out_dir = Path(out_dir)
    check_out_dir(out_dir, force)
    model, state, path = model_and_state(checkpoint)
    mcfg, fcfg = model.cfg, model.ffn_cfg
    if fcfg.kind not in ARCHITECTURES:  # a newly registered FFN: say which transformers class fits it here
        raise ExportError(f"ffn.kind={fcfg.kind} has no Hugging Face architecture to export to "
                          f"(ARCHITECTURES: {', '.join(ARCHITECTURES)})")
    tok, tok_path, note = checkpoint_tokenizer(path, state, tokenizer)
    eos_id = tok.token_to_id(EOT) if tok is not None else None

    tensors = {}
    for name, t in state["model"].items():
        if mcfg.tie_embeddings and name == "output.weight":
            continue  # shares tok_embeddings.weight; safetensors stores no aliases
        tensors[to_hf_name(name, fcfg.kind)] = t.detach().to(torch_dtype).contiguous()
    exported_from = {"checkpoint": str(path.resolve()), "step": state.get("step"),
                     "tokenizer_sha256": state.get("data", {}).get("tokenizer_sha256"),
                     "model": state["config"]["model"], "ffn": state["config"]["ffn"]}
    config = hf_config(mcfg, fcfg, model.vocab_size, torch_dtype, eos_id, exported_from)
    measured = None
    if val_batches is not None and fcfg.kind == "srelu24":
        measured = val_loss_2to4_and_dense(model, state, path, val_batches)
        config.sparsity_2to4.update(measured)
    try:
        files = _write(out_dir, tensors, config, tok_path if tok is not None else None, mcfg.max_seq_len, eos_id)
    except OSError as e:
        raise ExportError(f"cannot write {out_dir}: {e}") from e
    return {"kind": fcfg.kind, "architecture": config.architectures[0], "checkpoint": str(path),
            "step": state.get("step"), "dtype": DTYPE_NAMES[torch_dtype], "files": files,
            "tokenizer": str(tok_path) if tok is not None else None, "tokenizer_note": note, "val_loss": measured}


def _write(out_dir: Path, tensors: dict, config, tok_path: Optional[Path], max_len: int, eos_id) -> list:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in EXPORT_FILES:  # only reached with force (or an empty dir): drop an earlier export's files
        (out_dir / stale).unlink(missing_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    _umask_mode(out_dir / WEIGHTS)  # safetensors writes it 0600
    config.save_pretrained(out_dir)
    files = [WEIGHTS, HF_CONFIG]
    if tok_path is not None:
        shutil.copyfile(tok_path, out_dir / TOKENIZER)
        _write_json(out_dir / TOKENIZER_CONFIG, tokenizer_config(max_len, eos_id is not None))
        files += [TOKENIZER, TOKENIZER_CONFIG]
    return files


# ---------------------------------------------------------------- load back


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {path}: {e}") from e


def config_from_hf(c: dict) -> tuple[ModelConfig, FFNConfig, int]:
    """Our model/ffn configs and vocabulary from a Llama or Arcee config.json. Our own export's
    `exported_from` supplies what HF's config has no field for (the srelu24 recipe, the run's
    names); without it a llama is swiglu and an arcee srelu."""
    model_type = c.get("model_type")
    if model_type not in ("llama", "arcee"):
        raise ExportError(f"config.json has model_type={model_type!r}, expected 'llama' or 'arcee'")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ExportError(f"config.json uses RoPE scaling {rope}; this model has plain RoPE")
    unsupported = {k: c.get(k) for k in ("attention_bias", "mlp_bias") if c.get(k)}
    act = c.get("hidden_act", "silu" if model_type == "llama" else "relu2")
    if act != ("silu" if model_type == "llama" else "relu2"):
        unsupported["hidden_act"] = act
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, dim // heads):
        unsupported["head_dim"] = c["head_dim"]
    if unsupported:
        raise ExportError(f"config.json has settings this model does not support: {unsupported}")
    ours = c.get("exported_from") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    mcfg = _dataclass_from(ModelConfig, ours.get("model") or {"name": model_type})
    for field, value in dict(dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
                             n_kv_heads=c.get("num_key_value_heads") or heads,
                             max_seq_len=c["max_position_embeddings"], rope_theta=float(theta),
                             norm_eps=c["rms_norm_eps"], tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                             init_std=c.get("initializer_range", 0.02)).items():
        setattr(mcfg, field, value)  # HF's fields are what the weights were written for
    if model_type == "llama":
        mcfg.swiglu_hidden = c["intermediate_size"]
    try:
        fcfg = _dataclass_from(FFNConfig, ours.get("ffn") or {"kind": "swiglu" if model_type == "llama" else "srelu"})
    except (TypeError, ValueError) as e:
        raise ExportError(f"config.json: unusable exported_from.ffn: {e}") from e
    if ARCHITECTURES.get(fcfg.kind, (None, None))[1] != model_type:
        raise ExportError(f"config.json: exported_from.ffn.kind={fcfg.kind} does not fit model_type={model_type}")
    fcfg.hidden_dim = c["intermediate_size"]
    return mcfg, fcfg, c["vocab_size"]


def load_exported(out_dir: Path) -> Transformer:
    """Our Transformer from an export directory (or any Llama / Arcee directory of the shapes it
    supports), in fp32 and eval mode; an srelu24 export comes back with 2:4 on (`sparsity_2to4`)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    if not (out_dir / HF_CONFIG).is_file():
        raise ExportError(f"{out_dir} holds no {HF_CONFIG}: not an export directory")
    c = _read_json(out_dir / HF_CONFIG)
    mcfg, fcfg, vocab = config_from_hf(c)
    try:
        weights = load_file(str(out_dir / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - missing file or a damaged header
        raise ExportError(f"cannot read {out_dir / WEIGHTS}: {type(e).__name__}: {e}") from e
    state = {from_hf_name(k, fcfg.kind): v for k, v in weights.items()}
    model = Transformer(mcfg, fcfg, vocab, eot_id=c.get("eos_token_id"))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise ExportError(f"{out_dir / WEIGHTS} does not fit the config's model: {str(e).splitlines()[-1].strip()}") from e
    allowed_missing = {"output.weight"} if mcfg.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ExportError(f"{out_dir / WEIGHTS} does not fit the config's model: missing "
                          f"{sorted(set(missing) - allowed_missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    model.set_2to4(bool(c.get("sparsity_2to4")))
    return model.eval()


__all__ = ["ExportError", "export_checkpoint", "load_exported", "model_from_checkpoint", "model_and_state",
           "checkpoint_tokenizer", "find_tokenizer", "hf_names", "to_hf_name", "from_hf_name"]
