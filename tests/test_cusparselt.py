"""srelu24_kernels/cusparselt/binding.py: cached cuSPARSELt plans give torch._cslt_sparse_mm's product bit for
bit (GPU), and fall back to torch's op with a warning when the library cannot be used (CPU); the
algorithm id per shape: searched and checked, or set by ffn.sparse_gemm_alg."""
import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

import srelu24_kernels.cusparselt.binding as C


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


class _FakePlan:
    """Stands in for a cuSPARSELt plan on CPU: its product is a chosen function of A and B."""
    destroyed = []

    def __init__(self, lib, m, k, n, b_transposed, alg, device, transpose_result=False, e4m3=False, product=None,
                 fail=False):
        if fail:
            raise ValueError("plan init failed")
        self.product = product

    def run(self, a, b):
        return self.product(a, b)

    def destroy(self):
        _FakePlan.destroyed.append(self)


@pytest.mark.parametrize("case", ["equal", "differs", "raises", "wrong orientation"])
def test_a_plan_is_kept_only_if_its_product_equals_torchs(monkeypatch, fresh_cache, case):
    """The once-per-shape check: a plan whose product differs from torch._cslt_sparse_mm, or that
    fails to build, is dropped (and released) with a warning naming the shape; torch's op is used."""
    a, b = torch.randn(64, 36).bfloat16(), torch.randn(64, 32).bfloat16()
    torch_product = torch.randn(64, 32).bfloat16()
    monkeypatch.setattr(torch, "_cslt_sparse_mm", lambda a, b, **kw: torch_product, raising=False)
    monkeypatch.setattr(C, "_library", lambda device: object())
    product = {"equal": lambda a, b: torch_product.clone(), "differs": lambda a, b: torch_product + 1,
               "raises": None, "wrong orientation": lambda a, b: torch_product.t().contiguous()}[case]
    monkeypatch.setattr(C, "_Plan", lambda *args: _FakePlan(*args, product=product, fail=case == "raises"))
    _FakePlan.destroyed.clear()
    key = (0, 64, 64, 32, False, 0, False, False)
    if case == "equal":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert isinstance(C._new_plan(a, b, key), _FakePlan)
        assert not _FakePlan.destroyed
    else:
        match = "plan init failed" if case == "raises" else "differs from torch's for A \\[64, 64\\], B \\[64, 32\\]"
        with pytest.warns(RuntimeWarning, match=match):
            assert C._new_plan(a, b, key) is None
        assert len(_FakePlan.destroyed) == (0 if case == "raises" else 1)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(64, 64, 32), (4032, 1024, 256), (2048, 8192, 2048), (8192, 2048, 512)])
@pytest.mark.parametrize("b_transposed,transpose_result", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("searched", [False, True])
def test_cached_plan_equals_torch_bit_for_bit(fresh_cache, m, k, n, b_transposed, transpose_result, searched):
    """Default and searched algorithm ids (the FFN runs the searched ones), row- and column-major
    products (dW2 is written transposed); the second call reuses the plan on fresh inputs."""
    from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4

    def operands():
        a, _ = srelu_sparsify_2to4(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_transposed else \
            torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        return a, b

    a, b = operands()
    alg = torch._C._cusparselt.mm_search(a, b, None, None, None, transpose_result)[0] if searched else 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: the plan must be taken
        C.cached_mm(a, b, alg, transpose_result)
        a2, b2 = operands()
        again = C.cached_mm(a2, b2, alg, transpose_result)  # the cached plan, new inputs
    assert sum(p is not None for p in C._PLANS.values()) == 1
    want = C.torch_mm(a2, b2, alg, transpose_result)
    assert again.shape == ((n, m) if transpose_result else (m, n)) and torch.equal(again, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 192), (8192, 2048, 512)])
@pytest.mark.parametrize("transpose_result", [False, True])
def test_cached_e4m3_plan_equals_torch_bit_for_bit(fresh_cache, m, k, n, transpose_result):
    """e4m3 A and K-major B, bf16 out (srelu24_kernels/float8/sparse.py's GEMMs), at the searched id."""
    from srelu24_kernels.float8 import sparse as fp8_sparse
    from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4

    def operands():
        buf, _ = srelu_sparsify_2to4(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        a8, _ = fp8_sparse.compressed_to_e4m3(buf, m, k)
        b8, _ = fp8_sparse.kmajor_e4m3(torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t())
        return a8, b8

    a, b = operands()
    alg = torch._C._cusparselt.mm_search(a, b, None, None, torch.bfloat16, transpose_result)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.cached_mm(a, b, alg, transpose_result)
        a2, b2 = operands()
        again = C.cached_mm(a2, b2, alg, transpose_result)
    assert sum(p is not None for p in C._PLANS.values()) == 1
    want = C.torch_mm(a2, b2, alg, transpose_result)
    assert again.dtype == torch.bfloat16 and torch.equal(again, want)


@pytest.mark.gpu
def test_inputs_the_plans_are_not_built_for_go_to_torchs_op(fresh_cache):
    """A B in neither layout is made contiguous first; fp16 operands get no (bf16) plan."""
    from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4

    a, _ = srelu_sparsify_2to4(torch.randn(128, 64, device="cuda", dtype=torch.bfloat16))
    strided = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)[:, ::2]  # [64, 32], neither layout
    assert torch.equal(C.cached_mm(a, strided, 0), torch._cslt_sparse_mm(a, strided.contiguous()))
    planned = set(C._PLANS)
    C.cached_mm(a.view(torch.float16), strided.contiguous().view(torch.float16), 0)
    assert set(C._PLANS) == planned  # the fp16 call went straight to torch's op


@pytest.fixture
def fresh_algs(monkeypatch):
    monkeypatch.setattr(C, "_SEARCHED", {})
    monkeypatch.setattr(C, "_FIXED", [None])


def _fake_search(monkeypatch, count: int, differs=(), refused_from=None, ms=None, product=None):
    """torch's mm_search saying there are `count` ids (cuSPARSELt's ALG_CONFIG_MAX_ID, the tuple's
    last); torch_mm's product at the ids in `differs` unlike id 0's, ids from `refused_from` on
    refused; each id timed at ms[id] (1 ms if not given). (mm_search calls, torch_mm's ids, timed ids)"""
    searches, asked, timed = [], [], []
    monkeypatch.setattr(torch._C, "_cusparselt", SimpleNamespace(
        mm_search=lambda *args: searches.append(args) or (0, 1, 0, count)), raising=False)

    def torch_mm(a, b, i, t=False):
        asked.append(i)
        if refused_from is not None and i >= refused_from:
            raise RuntimeError(f"alg_id {i} out of range")
        out = torch.ones(4, 4) if product is None else product.clone()
        return out * 2 if i in differs else out

    monkeypatch.setattr(C, "torch_mm", torch_mm)
    monkeypatch.setattr(C, "_time_ms", lambda a, b, i, t: timed.append(i) or (ms or {}).get(i, 1.0))
    return searches, asked, timed


@pytest.mark.parametrize("differs", [False, True])
def test_the_fastest_id_is_kept_if_its_product_matches_id_0_and_logged_once(monkeypatch, fresh_algs, caplog, differs):
    searches, _, timed = _fake_search(monkeypatch, 31, differs=set(range(1, 31)) if differs else (), ms={21: 0.5})
    a, b = torch.zeros(64, 36, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=C.__name__):
        got = [C.searched_alg(a, b), C.searched_alg(a, b)]
    assert got == [0, 0] if differs else [21, 21]
    # cached per shape; every id timed in each of the interleaved rounds
    assert len(searches) == 1 and timed == ([0] if differs else list(range(31))) * C._ROUNDS
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "A [64, 36]" in msg and "B [64, 32]" in msg
    if differs:
        assert msg.endswith("algorithm 0 (the fastest of 1 ids timed: 1.000 ms, id 0 1.000 ms; rows within "
                            "0.0e+00 of id 0's; left out, further from id 0's: "
                            + ", ".join(f"{i} (1.0e+00)" for i in range(1, 31)) + ")")
    else:
        assert msg.endswith("algorithm 21 (the fastest of 31 ids timed: 0.500 ms, id 0 1.000 ms; rows within "
                            "0.0e+00 of id 0's)")


def test_bf16_rounding_passes_and_one_wrong_row_does_not(monkeypatch, fresh_algs):
    """Id 1 differs from id 0 by rounding (0.5% in every row): kept. Id 2 is 5% off in one row of
    64, 0.6% of the whole product's norm: left out, though the faster."""
    monkeypatch.setattr(torch._C, "_cusparselt", SimpleNamespace(mm_search=lambda *args: (0, 1, 0, 3)), raising=False)
    ref = torch.ones(64, 100)
    products = {0: ref, 1: ref * 1.005, 2: torch.cat([ref[:1] * 1.05, ref[1:]])}
    monkeypatch.setattr(C, "torch_mm", lambda a, b, i, t=False: products[i])
    monkeypatch.setattr(C, "_time_ms", lambda a, b, i, t: {0: 1.0, 1: 0.5, 2: 0.1}[i])
    assert ((products[2] - ref).norm() / ref.norm()).item() < 1e-2
    assert C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32)) == 1


def test_an_id_whose_product_differs_is_passed_over_for_the_next_fastest(monkeypatch, fresh_algs):
    """At the 7B FFN's shape id 6 was once the fastest but its product is not id 0's: the next
    fastest valid id is chosen, not id 0."""
    _fake_search(monkeypatch, 24, differs={6}, ms={6: 0.4, 21: 0.5, 0: 0.9})
    assert C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32)) == 21


def test_the_count_mm_search_gives_is_not_an_id(monkeypatch, fresh_algs):
    """torch 2.11 answered (21, -1, 2, 24) where ids 0-23 ran and 24 was refused."""
    _, asked, _ = _fake_search(monkeypatch, 24, refused_from=24)
    C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32))
    assert max(asked) == 23


def test_refused_ids_are_skipped_where_the_count_is_unknown(monkeypatch, fresh_algs):
    _, _, timed = _fake_search(monkeypatch, 30, refused_from=5, ms={4: 0.1})
    monkeypatch.setattr(torch._C, "_cusparselt", SimpleNamespace(mm_search=lambda *args: 3), raising=False)
    assert C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32)) == 4 and timed == [0, 1, 2, 3, 4] * C._ROUNDS


def test_an_all_zero_product_keeps_every_id(monkeypatch, fresh_algs):
    """Zero activations give a zero product at every id: no id differs, the fastest is kept."""
    _fake_search(monkeypatch, 4, product=torch.zeros(8, 8), ms={3: 0.2})
    assert C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32)) == 3


def test_a_failed_search_caches_nothing(monkeypatch, fresh_algs):
    _fake_search(monkeypatch, 4)

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(C, "_time_ms", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32))
    assert not C._SEARCHED
    monkeypatch.setattr(C, "_time_ms", lambda a, b, i, t: {2: 0.1}.get(i, 1.0))
    assert C.searched_alg(torch.zeros(64, 36), torch.zeros(64, 32)) == 2


def test_the_timer_runs_the_product_on_the_cpu_stand_in(monkeypatch):
    calls = []
    monkeypatch.setattr(C, "torch_mm", lambda a, b, i, t=False: calls.append(i))
    assert C._time_ms(torch.zeros(64, 36), torch.zeros(64, 32), 7, False, reps=3) >= 0 and calls == [7] * 4


def test_a_set_algorithm_is_used_for_every_shape_without_a_search(monkeypatch, fresh_algs, caplog):
    searches, _, _ = _fake_search(monkeypatch, 30)
    C.set_algorithm(3)
    with caplog.at_level(logging.INFO, logger=C.__name__):
        got = [C.searched_alg(torch.zeros(64, 36), torch.zeros(64, n), t) for n in (32, 64) for t in (False, True)]
    assert got == [3] * 4 and not searches
    assert len(caplog.records) == 4 and all(r.getMessage().endswith("algorithm 3 (set by ffn.sparse_gemm_alg)")
                                            for r in caplog.records)
    with pytest.raises(ValueError, match="integer >= 0"):
        C.set_algorithm(-1)


def test_ffn_sparse_gemm_alg_reaches_the_gemms(fresh_algs):
    """A model built from the config sets the id for the process (ffn.sparse_gemm_alg=null: searched)."""
    from helpers import compose_config, to_object
    from model.ffn import SReLU24

    for value, want in (("5", 5), ("null", None)):
        cfg = to_object(compose_config(["ffn=srelu24", f"ffn.sparse_gemm_alg={value}"]))
        SReLU24.from_config(64, 256, cfg.ffn)
        assert C._FIXED == [want]
