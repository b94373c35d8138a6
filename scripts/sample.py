"""Generate text from a checkpoint, with the KV cache (model/generate.py).

    python scripts/sample.py runs/demo/<time>/checkpoints/step_00001000 "def fibonacci(n):"
    python scripts/sample.py CKPT "import os" --temperature 0.8 --top-k 50 --num-samples 3 --seed 1
    python scripts/sample.py CKPT "x = " --temperature 0            # greedy

The model is rebuilt from the checkpoint's own config; the tokenizer is the tokenizer.json of
the run's shards (run_info.json next to checkpoints/), or --tokenizer. srelu24 checkpoints run
with 2:4 sparsity on once their step has reached ffn.dense_warmup_steps, as training would
continue. Progress notes go to stderr, the text to stdout; an empty prompt starts from
<|endoftext|> (the document separator).
"""
import argparse
import dataclasses
import json
import random
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from data.errors import DataError  # noqa: E402
from data.tokenizer import EOT, load_tokenizer, tokenizer_sha256  # noqa: E402
from model import FFNConfig, ModelConfig, Transformer  # noqa: E402
from model.generate import generate  # noqa: E402
from training.checkpoint import load_checkpoint  # noqa: E402
from training.errors import CheckpointError  # noqa: E402


class SampleError(Exception):
    """Ends the script with one `error: ...` line and exit status 2."""


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def config_of(cls, values: dict):
    """A config dataclass from the checkpoint's resolved config (keys it does not know are ignored)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def load_model(path: Path, device: torch.device) -> tuple[Transformer, dict]:
    if not path.exists():
        raise SampleError(f"checkpoint {path} does not exist")
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:
        raise SampleError(str(e)) from None
    config = state.get("config") or {}
    if "model" not in config or "ffn" not in config:
        raise SampleError(f"checkpoint {path} holds no model/ffn config")
    mcfg = config_of(ModelConfig, config["model"])
    fcfg = config_of(FFNConfig, config["ffn"])
    vocab = state.get("model_shape", {}).get("vocab_size") or state["model"]["tok_embeddings.weight"].shape[0]
    model = Transformer(mcfg, fcfg, vocab)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state


def find_tokenizer(ckpt: Path, given: Optional[str]) -> Path:
    if given:
        return Path(given)
    run_dir = ckpt.resolve().parent.parent  # <run>/checkpoints/step_XXXXXXXX
    info = run_dir / "run_info.json"
    if not info.is_file():
        raise SampleError(f"no {info} to find the tokenizer from; pass --tokenizer PATH/tokenizer.json")
    shard_dir = json.loads(info.read_text()).get("shard_dir")
    if not shard_dir:
        raise SampleError(f"{info} names no shard_dir; pass --tokenizer PATH/tokenizer.json")
    return Path(shard_dir) / "tokenizer.json"


def sparsity_note(model: Transformer, state: dict) -> str:
    """Switch srelu24's 2:4 on or off as training would continue from this step; say which."""
    ffn = model.ffn_cfg
    if ffn.kind != "srelu24":
        return ""
    step = state.get("step", 0)
    on = step >= ffn.dense_warmup_steps
    model.set_2to4(on)
    if on:
        return f"srelu24: 2:4 sparsity on (step {step} >= ffn.dense_warmup_steps={ffn.dense_warmup_steps})"
    return f"srelu24: dense, 2:4 off (step {step} < ffn.dense_warmup_steps={ffn.dense_warmup_steps})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint directory of a run (<run>/checkpoints/step_XXXXXXXX)")
    p.add_argument("prompt", help="the text to continue (may be empty)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed, printed")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's, via run_info.json)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-samples", type=int, default=1)
    a = p.parse_args(argv)
    try:
        if a.device == "cuda" and not torch.cuda.is_available():
            raise SampleError("--device cuda but CUDA is not available; use --device cpu")
        if a.temperature < 0 or (a.top_k is not None and a.top_k < 1) or a.num_samples < 1 or a.max_new_tokens < 0:
            raise SampleError("need --temperature >= 0, --top-k >= 1, --num-samples >= 1, --max-new-tokens >= 0")
        ckpt = Path(a.checkpoint)
        model, state = load_model(ckpt, torch.device(a.device))
        tok_path = find_tokenizer(ckpt, a.tokenizer)
        try:
            tok = load_tokenizer(tok_path)
        except DataError as e:
            raise SampleError(str(e)) from None
        trained_with = state.get("data", {}).get("tokenizer_sha256")
        if trained_with and tokenizer_sha256(tok) != trained_with:
            note(f"warning: {tok_path} is not the tokenizer this checkpoint was trained with")
        eos_id = tok.token_to_id(EOT)
        ids = tok.encode(a.prompt).ids if a.prompt else [eos_id]
        seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
        gen = torch.Generator().manual_seed(seed)

        note(f"checkpoint {ckpt} (step {state.get('step')}), {model.ffn_cfg.kind}, {a.device}, seed {seed}")
        if msg := sparsity_note(model, state):
            note(msg)
        with warnings.catch_warnings():  # the CPU 2:4 reference path is expected here
            warnings.filterwarnings("ignore", message="srelu24: using the pure-PyTorch")
            for i in range(a.num_samples):
                try:
                    new = generate(model, ids, a.max_new_tokens, a.temperature, a.top_k, eos_id, gen)
                except ValueError as e:
                    raise SampleError(str(e)) from None
                if a.num_samples > 1:
                    print(f"--- sample {i + 1}/{a.num_samples}")
                print(tok.decode(ids + new) if a.prompt else tok.decode(new), flush=True)
                if len(new) < a.max_new_tokens and (not new or new[-1] != eos_id):
                    note(f"(stopped at the model's context, model.max_seq_len={model.cfg.max_seq_len})")
    except SampleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
