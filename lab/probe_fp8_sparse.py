"""The srelu24 FFN's sparse GEMM shapes in bf16 and e4m3, dense and 2:4 (cuSPARSELt), side by side,
with whatever libcusparseLt the process loaded (run it once per library to compare versions):

    python lab/probe_fp8_sparse.py --tokens 8192 16384 --out fp8.json

Per shape [M, K] x [K, N] (A 2:4 along K; B K-major, the transpose of a contiguous [N, K], which
fp8 tensor cores need): bf16 dense mm, bf16 2:4 (the id kernels/srelu24_ffn.sparse_mm picks),
e4m3 dense torch._scaled_mm (fast and exact accumulation), and e4m3 2:4 through
torch._cslt_sparse_mm with bf16 output for every algorithm id, each checked against an fp32
product of the same e4m3 values. Medians of triton's do_bench.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.srelu24_ffn import sparse_mm  # noqa: E402

E4M3 = torch.float8_e4m3fn


def random_24(m: int, k: int) -> torch.Tensor:
    """A bf16 [m, k] matrix of N(0, 1) values with 2 of every 4 along k kept, at random positions."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    keep = torch.rand(m, k // 4, 4, device="cuda").argsort(-1) < 2
    return a * keep.reshape(m, k)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=250, return_mode="median")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def probe_shape(m: int, k: int, n: int, max_ids: int) -> dict:
    a = random_24(m, k)
    bt = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5  # B = bt.t(): K-major
    b = bt.t()
    row = {"M": m, "K": k, "N": n, "flop": 2 * m * k * n}
    row["bf16 dense"] = bench(lambda: a @ b)
    c16 = torch._cslt_compress(a)
    sparse_mm(c16, b)
    row["bf16 2:4"] = bench(lambda: sparse_mm(c16, b))
    a8, bt8 = a.to(E4M3), (bt * 16).to(E4M3)
    b8 = bt8.t()
    one = torch.ones((), device="cuda")
    want = a8.float() @ b8.float()
    for fast in (True, False):
        got = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
        row[f"e4m3 dense{' fast' if fast else ''} rel"] = rel(got, want)
        row[f"e4m3 dense{' fast' if fast else ''}"] = bench(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast))
    try:
        c8 = torch._cslt_compress(a8)
    except RuntimeError as e:
        row["e4m3 2:4 error"] = str(e)[:160]
        return row
    ids = {}
    for alg in range(max_ids):
        try:
            got = torch._cslt_sparse_mm(c8, b8, out_dtype=torch.bfloat16, alg_id=alg)
        except RuntimeError as e:
            ids[alg] = {"error": str(e)[:120]}
            break
        err = rel(got, want)
        ids[alg] = {"rel": err, "ms": bench(lambda: torch._cslt_sparse_mm(c8, b8, out_dtype=torch.bfloat16,
                                                                       alg_id=alg))}
    row["e4m3 2:4 ids"] = ids
    good = [(v["ms"], i) for i, v in ids.items() if "ms" in v and v["rel"] < 1e-2]
    row["e4m3 2:4 best"], row["e4m3 2:4 best id"] = min(good) if good else (float("nan"), None)
    if good:  # per-row scales (alpha, length M: the sparse operand's rows) and the transposed result (dW2)
        alg, alpha = row["e4m3 2:4 best id"], torch.rand(m, device="cuda") + 0.5
        scaled = want * alpha[:, None]
        for tr in (False, True):
            def run():
                return torch._cslt_sparse_mm(c8, b8, alpha=alpha, out_dtype=torch.bfloat16, alg_id=alg,
                                             transpose_result=tr)
            try:
                got = run()
                row[f"alpha{' transposed' if tr else ''} rel"] = rel(got.t() if tr else got, scaled)
                row[f"alpha{' transposed' if tr else ''} ms"] = bench(run)
            except RuntimeError as e:
                row[f"alpha{' transposed' if tr else ''} error"] = str(e)[:120]
    try:  # what torch's own search picks
        row["e4m3 2:4 search id"] = torch._cslt_sparse_mm_search(c8, b8, out_dtype=torch.bfloat16)
    except RuntimeError as e:
        row["e4m3 2:4 search id"] = str(e)[:80]
    # a B row-major (N-major) for the record: fp8 wgmma has no transposed B
    try:
        b8r = b8.contiguous()
        row["e4m3 2:4 B row-major"] = bench(lambda: torch._cslt_sparse_mm(c8, b8r, out_dtype=torch.bfloat16))
    except RuntimeError as e:
        row["e4m3 2:4 B row-major"] = str(e)[:80]
    return row


def pieces(t: int, d: int, f: int) -> dict:
    """kernels/fp8_sparse.py's passes around each e4m3 GEMM at the FFN's shapes, ms."""
    from kernels import fp8_sparse
    from kernels.cslt_layout import compress
    from kernels.srelu24_reference import mask_2to4

    out = {}
    for m, k in ((t, f), (f, t)):
        a = torch.relu(torch.randn(m, k, device="cuda")) ** 2
        buf = compress(a.bfloat16(), mask_2to4(a))
        out[f"compressed_to_e4m3 [{m}, {k}]"] = bench(lambda: fp8_sparse.compressed_to_e4m3(buf, m, k))
        out[f"copy of the bf16 buffer [{m}, {k}]"] = bench(lambda: buf.clone())
    w1, x = torch.randn(f, d, device="cuda", dtype=torch.bfloat16), torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    out[f"kmajor_e4m3 W2^T (rows of [{d}, {f}])"] = bench(lambda: fp8_sparse.kmajor_e4m3(w1.t().contiguous().t()))
    out[f"kmajor_e4m3 W1 (transposed [{f}, {d}])"] = bench(lambda: fp8_sparse.kmajor_e4m3(w1))
    out[f"kmajor_e4m3 X (transposed [{t}, {d}])"] = bench(lambda: fp8_sparse.kmajor_e4m3(x))
    y, r, c = x.clone(), torch.ones(t, device="cuda"), torch.ones(d, device="cuda")
    out[f"unscale_ [{t}, {d}]"] = bench(lambda: fp8_sparse.unscale_(y, row_scale=r, col_scale=c))
    return out


def profile_ffn(t: int, d: int, f: int, recipe: str, sparse_float8: bool, iters: int = 5) -> list:
    """The srelu24 module (float8 `recipe`, its 2:4 GEMMs in e4m3 or bf16) fw+bw under torch.profiler:
    [(kernel, ms per fw+bw, calls per fw+bw)], the largest first."""
    from torch.profiler import ProfilerActivity, profile

    from model.ffn import SReLU24
    from training.config import Float8
    from training.float8 import convert
    from kernels.srelu24_reference import SReLU24Recipe

    m = SReLU24(d, f, SReLU24Recipe(token_permutation=False), sparse_float8=sparse_float8).cuda().to(torch.bfloat16)
    m.set_2to4(True)
    convert(torch.nn.ModuleDict({"ffn": m}), Float8(recipe), fsdp=False)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        m(x).backward(gy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            m(x).backward(gy)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / iters, e.count // iters) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=16512)
    ap.add_argument("--max-ids", type=int, default=24)
    ap.add_argument("--pieces", action="store_true", help="also time kernels/fp8_sparse.py's passes")
    ap.add_argument("--profile", default="", metavar="RECIPE",
                    help="also profile the srelu24 FFN fw+bw in float8 RECIPE, 2:4 GEMMs in e4m3 and in bf16")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: probe_fp8_sparse.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    version = torch.backends.cusparselt.version()
    print(f"cuSPARSELt {version}, {torch.cuda.get_device_name()}")
    rows = []
    for t in args.tokens:
        # forward Y = A24 W2^T and dX = dZ W1: [T, F] x [F, d]; weight gradients: [F, T] x [T, d]
        for m, k in ((t, args.hidden), (args.hidden, t)):
            rows.append(probe_shape(m, k, args.d, args.max_ids))
            print(json.dumps(rows[-1]), flush=True)
    if args.pieces:
        for t in args.tokens:
            for name, ms in pieces(t, args.d, args.hidden).items():
                print(f"| {name} | {ms:.3f} ms |")
    if args.profile:
        for sparse8 in (True, False):
            rows_p = profile_ffn(args.tokens[0], args.d, args.hidden, args.profile, sparse8)
            total = sum(r[1] for r in rows_p)
            print(f"\nsrelu24 fw+bw, float8 {args.profile}, 2:4 GEMMs in {'e4m3' if sparse8 else 'bf16'}, "
                  f"T={args.tokens[0]}: {total:.3f} ms of kernels")
            for name, ms, n in rows_p[:18]:
                print(f"|k| {ms:.3f} | {n} | {name[:110]} |")
    cols = ["bf16 dense", "bf16 2:4", "e4m3 dense fast", "e4m3 dense", "e4m3 2:4 best"]
    print(f"\ncuSPARSELt {version}: ms (TFLOP/s)")
    print("| M x K x N | " + " | ".join(cols) + " | e4m3 2:4 id (search) | e4m3 2:4 / dense fast |")
    print("|---" * (len(cols) + 3) + "|")
    for r in rows:
        cells = [f"{r[c]:.3f} ({r['flop'] / r[c] / 1e9:.0f})" if isinstance(r.get(c), float) else "-" for c in cols]
        ratio = r["e4m3 dense fast"] / r["e4m3 2:4 best"] if isinstance(r.get("e4m3 2:4 best"), float) else float("nan")
        print(f"| {r['M']} x {r['K']} x {r['N']} | " + " | ".join(cells)
              + f" | {r.get('e4m3 2:4 best id')} ({r.get('e4m3 2:4 search id')}) | {ratio:.2f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cusparselt": version, "device": torch.cuda.get_device_name(),
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
