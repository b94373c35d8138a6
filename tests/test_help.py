"""`python train.py --help` (configs/hydra/help/app.yaml): the experiments and groups it names are
exactly those in configs/, without the internal experiment/scale group."""
import re

import pytest

from helpers import ROOT, background, run_train

CONFIGS = ROOT / "configs"


def expand(word: str) -> list[str]:
    """'swiglu_{125m,1b}' -> ['swiglu_125m', 'swiglu_1b']."""
    m = re.match(r"^(.*)\{([^}]*)\}(.*)$", word)
    return [m.group(1) + o + m.group(3) for o in m.group(2).split(",")] if m else [word]


def section(text: str, title: str) -> list[str]:
    m = re.search(rf"^== {re.escape(title)} ==\n(.*?)\n\n", text, re.S | re.M)
    assert m, f"no '{title}' section in:\n{text[:2000]}"
    return m.group(1).splitlines()


@background
def launches(ctx):
    """`train.py --help`, launched with the session (helpers.background)."""
    return {"help_text": lambda: run_train(["--help"], timeout=120)}


@pytest.fixture(scope="module")
def help_text(launched):
    r = launched["help_text"].result()
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_help_names_every_experiment_and_only_those(help_text):
    named = [n for line in section(help_text, "Experiments (+experiment=NAME)") for n in expand(line.split()[0])]
    assert sorted(named) == sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
    assert "experiment/scale" not in help_text and "scale:" not in help_text


def test_help_lists_each_group_with_its_options(help_text):
    listed, group = {}, None
    for line in section(help_text, "Config groups (group=option)"):
        head, sep, options = line.strip().partition(":")
        if sep and "," not in head:
            group = head
        else:  # a continuation of the previous group's options
            options = line.strip()
        listed.setdefault(group, []).extend(o.strip() for o in options.split("  ")[0].split(",") if o.strip())
    listed = {g: sorted(o) for g, o in listed.items()}
    want = {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in CONFIGS.iterdir() if d.is_dir() and d.name not in ("experiment", "hydra")}
    want["hydra/launcher"] = sorted(p.stem for p in (CONFIGS / "hydra" / "launcher").glob("*.yaml"))
    assert listed == want


def test_help_switches_are_config_keys(help_text):
    from helpers import compose_config

    cfg = compose_config([])
    for line in section(help_text, "Main switches"):
        assignments = line.strip().split("  ")[0].split()
        assert assignments, line
        for assignment in assignments:
            key = assignment.split("=")[0]
            node = cfg
            for part in key.split("."):
                assert part in node, f"--help names {key}, which the config does not have"
                node = node[part]
