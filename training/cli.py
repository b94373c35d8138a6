"""The command line around Hydra: compose the config once before Hydra runs the job, so a bad
group option, key or type ends with ONE line (Hydra's own message, condensed) and exit 2; the
run's name; and the one-line error exit of a rejected run, which leaves no run directory."""
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

_NOISE = ("Config search path", "provider=", "Set the environment", "full_key", "reference_type", "object_type")
# Hydra's own flags: what they do (help, --cfg, shell completion, sweeps) is Hydra's business
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-p", "--package", "--resolve",
                "-i", "--info", "-m", "--multirun", "-sc", "--shell-completion", "-cp", "--config-path",
                "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")
# overrides that do not change what a run computes, left out of its name (wandb's display name),
# so that a stopped and resumed run keeps its name
NAME_EXCLUDES = ("experiment", "trainer.resume", "trainer.stop_at_step", "trainer.resume_overrides")


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
    # a resolver's own message (configs/logging/default.yaml's ${wandb_mode:...}) says what is wrong
    return re.sub(r"^\w+ raised while resolving interpolation: ", "", "; ".join(parts))


RANK_EXIT_DELAY_S = 5.0


def first_process() -> bool:
    """False on the ranks other than 0 of a torchrun or multi-task SLURM launch: a config error
    is printed once, by rank 0 (the others exit 2 silently)."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return os.environ[key] == "0"
    return True


def fail(message: str) -> None:
    """One `error:` line on stderr (rank 0 only), exit 2. The other ranks wait a moment first:
    torchrun stops every rank as soon as one exits, which could end rank 0 before it printed."""
    if first_process():
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK_EXIT_DELAY_S)
    sys.exit(2)


def check_overrides(config_dir: Path, argv: list[str]) -> None:
    """Exit 2 with one line if the overrides in argv do not compose into a valid config.
    With any of Hydra's own flags the command line is left to Hydra."""
    if any(a.split("=", 1)[0] in _HYDRA_FLAGS or a.startswith(("-cp", "-cn", "-cd")) for a in argv):
        return
    overrides = [a for a in argv if not a.startswith(("hydra.", "+hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            OmegaConf.to_object(compose("config", overrides=overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        cause = f"; {condense(str(e.__cause__))}" if e.__cause__ else ""
        fail(f"{condense(str(e))}{cause}")


def run_name(task_overrides: list[str], default: str) -> str:
    """The run's display name: its command-line overrides as key=value,... (sorted, as Hydra's
    override_dirname), without NAME_EXCLUDES and Hydra's own settings; `default` without any."""
    kept = []
    for o in task_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith(("hydra.", "hydra/")) or key in NAME_EXCLUDES:
            continue
        kept.append(o)
    return ",".join(sorted(kept)) or default


def hydra_only(run_dir: Path) -> bool:
    """A run directory that holds nothing but what Hydra writes before the job runs (.hydra/,
    the job's .log file)."""
    return run_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())


@contextmanager
def one_line_errors(run_dir: Path, errors: tuple):
    """`errors` end the run with one line and exit 2; a run directory that holds only Hydra's own
    files is removed (a rejected run leaves nothing behind). The line also goes to train.log when
    the directory stays. Under torchrun or SLURM only rank 0 removes it: every rank shares it, and a
    rank that removed it while another was still opening its log file there crashed that one with a
    traceback (rank 0's, before it printed its line, in a flaky test)."""
    try:
        yield
    except errors as e:
        if hydra_only(run_dir):
            if first_process():
                shutil.rmtree(run_dir, ignore_errors=True)
        else:
            _to_log_file(f"error: {e}")
        fail(str(e))


def _to_log_file(line: str) -> None:
    import logging

    record = logging.LogRecord("train", logging.ERROR, __file__, 0, line, None, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)
