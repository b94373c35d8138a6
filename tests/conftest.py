import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helpers  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip on machines without CUDA (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def background_launches(request, tmp_path_factory):
    """Every collected module's @background jobs (tests/helpers.py), started with the session."""
    with helpers.background_session(request.session, tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def launched(request):
    """This module's @background jobs: name -> Future."""
    return helpers.launched(request.module.__name__)


# Shared by the modules that train on a small corpus; a module may override either (other sizes,
# an unprepared cache). Module scope: each module gets its own (its @background jobs get the same).
@pytest.fixture(scope="module")
def corpus(request, tmp_path_factory):
    return helpers.module_data(request.module.__name__, tmp_path_factory, "corpus")


@pytest.fixture(scope="module")
def cache(request, tmp_path_factory, corpus):
    """A shard cache prepared once from `corpus`."""
    return helpers.module_data(request.module.__name__, tmp_path_factory, "cache")
