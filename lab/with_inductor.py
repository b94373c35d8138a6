"""Run a script with inductor settings that have no environment variable, for A/B runs:

    python lab/with_inductor.py triton.prefer_nd_tiling=1 -- scripts/bench_step.py +experiment=swiglu_7b --layers 8

Each KEY=VALUE sets torch._inductor.config.KEY (VALUE 0/1 for booleans, else an int, else the
string) before the script runs as __main__ in this process.
"""
import runpy
import sys
from pathlib import Path


def set_option(key: str, value) -> bool:
    """torch._inductor.config.KEY = value (KEY dotted, e.g. triton.prefer_nd_tiling; a string value
    is read as an int, or as 0/1 for a boolean option). False where inductor has no such option."""
    import torch._inductor.config as config

    obj, _, attr = key.rpartition(".")
    target = getattr(config, obj) if obj else config
    if not hasattr(target, attr):
        return False
    if isinstance(value, str):
        value = int(value) if value.lstrip("-").isdigit() else value
        value = bool(value) if isinstance(getattr(target, attr), bool) else value
    setattr(target, attr, value)
    return True


def main() -> int:
    if "--" not in sys.argv:
        print("usage: python lab/with_inductor.py KEY=VALUE ... -- SCRIPT [ARGS]", file=sys.stderr)
        return 2
    cut = sys.argv.index("--")
    for item in sys.argv[1:cut]:
        key, _, value = item.partition("=")
        if not set_option(key, value):
            print(f"error: torch._inductor.config has no {key}", file=sys.stderr)
            return 2
        print(f"inductor: {key} = {value}", file=sys.stderr)
    script = sys.argv[cut + 1]
    sys.argv = sys.argv[cut + 1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
