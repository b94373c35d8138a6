import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import prepare_shared_cache, write_corpus  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip on machines without CUDA (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Shared by the modules that train on a small corpus; a module may override either (other sizes,
# an unprepared cache). Module scope: each module gets its own.
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory, corpus):
    """A shard cache prepared once from `corpus`."""
    return prepare_shared_cache(tmp_path_factory, corpus)
