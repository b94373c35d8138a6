"""Train a Llama-style transformer with a SwiGLU, Squared-ReLU or 2:4-sparse Squared-ReLU FFN.

    python train.py +experiment=demo ffn=srelu24          # one run
    python train.py -m ffn=swiglu,srelu,srelu24 +experiment=demo   # a sweep, one job per variant
    python train.py +experiment=sparse_7b --cfg job       # print the composed config
    python train.py +experiment=sparse_7b trainer.dry_run=true     # sizes and FLOPs, nothing allocated
"""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.errors import DataError
from training.cli import check_overrides, one_line_errors, run_name
from training.config import register_configs
from training.errors import CheckpointError, ConfigError, TrainingError

register_configs()
CONFIGS = Path(__file__).resolve().parent / "configs"


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="config")
def main(cfg: DictConfig) -> None:
    from training.logger import console_logging
    from training.loop import train  # after Hydra has parsed the command line: --help stays fast

    console_logging()
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    with one_line_errors(run_dir, (ConfigError, DataError, CheckpointError, TrainingError)):
        train(cfg, run_dir, run_name(list(hc.overrides.task), cfg.name))


if __name__ == "__main__":
    check_overrides(CONFIGS, sys.argv[1:])
    try:
        main()
    except SystemExit as e:  # errors above, and Hydra's own (exit 1)
        code = e.code
    else:
        code = 0
    if "training.distributed" in sys.modules:  # imported by a run: it knows how a process that joined a group exits
        sys.modules["training.distributed"].exit_process(code)
    sys.exit(code)
