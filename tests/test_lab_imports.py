"""The lab's code stays importable: every module of lab/ imports on a CPU machine, no GPU needed
(their GPU work runs only under `if __name__ == "__main__"`)."""
import importlib
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parent.parent / "lab"
MODULES = sorted(p.stem for p in LAB.glob("*.py") if p.stem != "__init__")


def test_the_lab_has_modules():
    assert MODULES


@pytest.mark.parametrize("name", MODULES)
def test_lab_module_imports(name):
    importlib.import_module(f"lab.{name}")
