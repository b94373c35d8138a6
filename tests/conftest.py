import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip on machines without CUDA (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
