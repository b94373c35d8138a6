"""kernels/cusparselt.py: cached cuSPARSELt plans give torch._cslt_sparse_mm's product bit for
bit (GPU), and fall back to torch's op with a warning when the library cannot be used (CPU)."""
import warnings

import pytest
import torch

import kernels.cusparselt as C


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(C, "_LIB", {})
    monkeypatch.setattr(C, "_PLANS", {})


def test_missing_library_warns_once_and_is_not_retried(monkeypatch, fresh_cache):
    calls = []
    monkeypatch.setattr(C, "_find_library", lambda: calls.append(1))
    with pytest.warns(RuntimeWarning, match="libcusparseLt not found.*torch._cslt_sparse_mm"):
        assert C._library(torch.device("cuda", 0)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert C._library(torch.device("cuda", 0)) is None  # remembered: no second search, no second warning
    assert len(calls) == 1


def test_unloadable_library_falls_back_with_the_reason(monkeypatch, fresh_cache, tmp_path):
    bogus = tmp_path / "libcusparseLt.so.0"
    bogus.write_text("not a shared object")
    monkeypatch.setattr(C, "_find_library", lambda: str(bogus))
    monkeypatch.setattr(torch.cuda, "device", lambda idx: _NullContext())
    with pytest.warns(RuntimeWarning, match=str(bogus)):
        assert C._library(torch.device("cuda", 0)) is None


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(64, 64, 32), (4032, 1024, 256), (2048, 8192, 2048), (8192, 2048, 512)])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_cached_plan_equals_torch_bit_for_bit(fresh_cache, m, k, n, b_transposed):
    from kernels.sparsify24 import srelu_sparsify24

    z = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, _ = srelu_sparsify24(z)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_transposed else \
        torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: the plan must be taken
        got = C.cached_mm(a, b, 0)
        again = C.cached_mm(a, b, 0)  # the cached plan, second use
    assert any(p is not None for p in C._PLANS.values())
    want = torch._cslt_sparse_mm(a, b)
    assert torch.equal(got, want) and torch.equal(again, want)
