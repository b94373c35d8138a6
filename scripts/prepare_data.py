"""Tokenize a corpus into token shards, with the same config as train.py (which also does
this itself when shards are missing). Prints where the shards are and what they hold.

    python scripts/prepare_data.py +experiment=demo
    python scripts/prepare_data.py data=fineweb_edu data.max_documents=1000000
    python scripts/prepare_data.py data=files data.paths='[corpus/*.jsonl]'
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from data.errors import DataError  # noqa: E402
from data.shards import prepare  # noqa: E402
from training.config import register_configs  # noqa: E402


def main(overrides: list[str]) -> None:
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = OmegaConf.to_object(compose("config", overrides=overrides))
        shard_dir, manifest = prepare(cfg.data, ROOT, progress=True)
    except (HydraException, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"shards: {shard_dir}")
    print(f"  {manifest.source}")
    print(f"  vocabulary {manifest.vocab_size}, tokenizer sha256 {manifest.tokenizer_sha256[:12]}")
    for split in ("train", "val"):
        print(f"  {split}: {manifest.tokens(split):,} tokens in {len(manifest.splits[split])} shard(s), "
              f"{manifest.documents[split]:,} documents")


if __name__ == "__main__":
    main(sys.argv[1:])
