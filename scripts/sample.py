"""Generate text from a checkpoint, with the KV cache (model/generate.py).

    python scripts/sample.py runs/demo/<time>/checkpoints/step_00001000 "def fibonacci(n):"
    python scripts/sample.py CKPT "import os" --temperature 0.8 --top-k 50 --num-samples 3 --seed 1
    python scripts/sample.py CKPT "x = " --temperature 0            # greedy

The model is rebuilt from the checkpoint's own config; the tokenizer is the tokenizer.json of
the run's shards (run_info.json next to checkpoints/), or --tokenizer; either must be the one the
checkpoint was trained with (its recorded hash). Both are loaded as training/export.py loads them.
srelu24 checkpoints run with 2:4 sparsity on once their step has reached ffn.dense_warmup_steps, as training would
continue. Progress notes go to stderr, the text to stdout; an empty prompt starts from
<|endoftext|> (the document separator).
"""
import argparse
import random
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from data.tokenizer import EOT  # noqa: E402
from model import Transformer  # noqa: E402
from model.generate import generate  # noqa: E402
from training.export import ExportError, checkpoint_tokenizer, model_and_state  # noqa: E402


class SampleError(Exception):
    """Ends the script with one `error: ...` line and exit status 2."""


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(ckpt: Path, tokenizer, device: torch.device):
    """The model (eval mode, on `device`), the checkpoint's state and its tokenizer: training/export.py's
    loading, the same as an export's."""
    try:
        model, state, path = model_and_state(ckpt)
        tok, tok_path, why = checkpoint_tokenizer(path, state, Path(tokenizer) if tokenizer else None)
    except ExportError as e:
        raise SampleError(str(e)) from None
    if tok is None:
        raise SampleError(why if "--tokenizer" in why else why + "; pass --tokenizer PATH/tokenizer.json")
    return model.to(device), state, tok


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
        model, state, tok = load(ckpt, a.tokenizer, torch.device(a.device))
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
