"""Start-up check of the command line: compose the config once before Hydra runs the job, so a
bad group option, key or type ends with ONE line (Hydra's own message, condensed) and exit 2."""
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

_NOISE = ("Config search path", "provider=", "Set the environment", "full_key", "reference_type", "object_type")


def condense(message: str) -> str:
    """Hydra's multi-line error as one line; option lists joined with commas."""
    parts, options = [], []
    for line in message.splitlines():
        if line.startswith("\t") and not line.strip().startswith("provider="):
            options.append(line.strip())
        elif line.strip() and not line.strip().startswith(_NOISE):
            parts.append(line.strip().rstrip(":."))
    if options:
        parts[-1] += ": " + ", ".join(options)
    return "; ".join(parts)


def check_overrides(config_dir: Path, argv: list[str]) -> None:
    """Exit 2 with one line if the overrides in argv do not compose into a valid config.
    Sweeps (-m) and Hydra's own flags are left to Hydra."""
    if any(a in ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "--info", "-i") or
           a.startswith(("--cfg", "--info", "--config", "-cp", "-cn")) for a in argv):
        return
    overrides = [a for a in argv if not a.startswith(("hydra.", "+hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            OmegaConf.to_object(compose("config", overrides=overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        cause = f"; {condense(str(e.__cause__))}" if e.__cause__ else ""
        print(f"error: {condense(str(e))}{cause}", file=sys.stderr)
        sys.exit(2)
