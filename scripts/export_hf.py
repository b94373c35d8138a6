"""Export a checkpoint as safetensors + config (the format: training/export.py's docstring).

    python scripts/export_hf.py runs/.../checkpoints/step_00001000 exports/my_model
    python scripts/export_hf.py runs/.../my_run exports/my_model --dtype bf16   # its newest checkpoint

swiglu -> a Hugging Face LlamaForCausalLM directory (config.json, model.safetensors);
srelu / srelu24 -> sparse24_config.json + model.safetensors under our names, loaded back with
training.export.load_exported. Both get the run's tokenizer.json + tokenizer_config.json when found.
An OUT_DIR that exists and is not empty is an error unless --force.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.export import DTYPES, ExportError, export_checkpoint  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint (<run>/checkpoints/step_XXXXXXXX) or a run directory (its newest)")
    p.add_argument("out_dir", type=Path, help="the export directory (created; must be empty unless --force)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR, replacing an earlier export")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json to ship instead of the run's")
    args = p.parse_args(argv)
    try:
        info = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.force, args.tokenizer)
    except ExportError as e:
        print(f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr)
        return 2
    fmt = "Hugging Face LlamaForCausalLM" if info["format"] == "llama" else "sparse24 (training.export.load_exported)"
    print(f"exported {info['checkpoint']} (step {info['step']}, ffn={info['kind']}, {info['dtype']}) -> {args.out_dir}")
    print(f"  format: {fmt}")
    print(f"  files: {', '.join(info['files'])}")
    if info["tokenizer"] is None:
        print(f"  warning: no tokenizer exported: {info['tokenizer_note']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
