"""Run a script with inductor settings that have no environment variable, for A/B runs:

    python lab/with_inductor.py triton.prefer_nd_tiling=1 -- scripts/bench_step.py +experiment=swiglu_7b --layers 8

Each KEY=VALUE sets torch._inductor.config.KEY (VALUE 0/1 for booleans, else an int, else the
string) before the script runs as __main__ in this process.
"""
import runpy
import sys
from pathlib import Path


def parse(value: str):
    for cast in (int,):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def main() -> int:
    if "--" not in sys.argv:
        print("usage: python lab/with_inductor.py KEY=VALUE ... -- SCRIPT [ARGS]", file=sys.stderr)
        return 2
    cut = sys.argv.index("--")
    import torch._inductor.config as config

    for item in sys.argv[1:cut]:
        key, _, value = item.partition("=")
        obj, _, attr = key.rpartition(".")
        target = getattr(config, obj) if obj else config
        if not hasattr(target, attr):
            print(f"error: torch._inductor.config has no {key}", file=sys.stderr)
            return 2
        old = getattr(target, attr)
        setattr(target, attr, bool(parse(value)) if isinstance(old, bool) else parse(value))
        print(f"inductor: {key} = {getattr(target, attr)!r}", file=sys.stderr)
    script = sys.argv[cut + 1]
    sys.argv = sys.argv[cut + 1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
