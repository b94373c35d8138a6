"""Export a checkpoint as a Hugging Face model directory (the format: training/export.py's docstring).

    python scripts/export_hf.py runs/.../checkpoints/step_00001000 exports/my_model
    python scripts/export_hf.py runs/.../my_run exports/my_model --dtype bf16   # its newest checkpoint
    python scripts/export_hf.py runs/.../srelu24_run exports/my_model --val-batches 0  # + val loss 2:4 vs dense

swiglu -> LlamaForCausalLM, srelu and srelu24 -> ArceeForCausalLM (config.json, model.safetensors),
loaded with transformers' AutoModelForCausalLM.from_pretrained(OUT_DIR), or as our model with
training.export.load_exported(OUT_DIR) (srelu24 with 2:4 on: transformers runs it dense). With the
run's tokenizer.json + tokenizer_config.json when found. An OUT_DIR that exists and is not empty is
an error unless --force.
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
    p.add_argument("--val-batches", type=int, default=None, metavar="N",
                   help="srelu24: first measure the validation loss with 2:4 and dense over N batches of the run's "
                        "validation split (0: all of it, on the CPU) and record both in config.json")
    args = p.parse_args(argv)
    try:
        info = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.force, args.tokenizer,
                                 args.val_batches)
    except ExportError as e:
        print(f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr)
        return 2
    print(f"exported {info['checkpoint']} (step {info['step']}, ffn={info['kind']}, {info['dtype']}) -> {args.out_dir}")
    print(f"  architecture: {info['architecture']} (transformers' AutoModelForCausalLM)")
    print(f"  files: {', '.join(info['files'])}")
    if info["kind"] == "srelu24":
        print("  note: trained with 2:4 activation sparsity; transformers computes the dense FFN "
              "(training.export.load_exported gives 2:4)")
    if info["val_loss"]:
        v = info["val_loss"]
        print(f"  validation loss over {v['val_windows']} windows of {v['seq_len']}: 2:4 {v['val_loss_2to4']:.4f}, "
              f"dense {v['val_loss_dense']:.4f}")
    if info["tokenizer"] is None:
        print(f"  warning: no tokenizer exported: {info['tokenizer_note']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
