"""Does a srelu24 row leave state that slows a later dense row of the same process?

`bench_step --rounds` found the 1B float8 srelu step at 694-702 ms as a process's first row and at
721-734 ms after a srelu24 row (1590-1620 MHz against 1740-1755, at the same ~693 W), with a fresh
model, the same seed and the same batches; at 7B shapes srelu after swiglu was fast and after
srelu24 slow (benchmarks/RESULTS.md). This probe runs bench_step's own rows (scripts/bench_step.py,
`bench`) in the order given and, before each, reads what a row could leave behind: the current
stream's L2 access-policy window and the device's persisting-L2 limit (through the CUDA runtime
torch loaded), memory reserved and held outside torch's allocator, and the number of cached
cuSPARSELt plans. The row `reset` destroys srelu24's cached plans and searched ids and empties
torch's cache (on an H100 it did not give srelu its speed back: benchmarks/RESULTS.md, "Which protocol
measures the 1B ratio").

    python lab/probe_row_order.py +experiment=study_speed trainer.cuda_graph=true trainer.ffn_stats_every=25 \
        --rows srelu,srelu,srelu24,srelu,reset,srelu --accum 4 --warmup 3 --steps 5 --out order.json

A row may add overrides of its own after colons, to split what a row leaves behind:
`--rows srelu,srelu24:trainer.cuda_graph=false,srelu` (srelu24 without the graphs),
`--rows srelu,srelu24:ffn.sparse_float8=false,srelu` (its 2:4 GEMMs in bf16).

--profile N profiles N more steps of each row (bench_step's kernel table) and prints, for a variant
that runs more than once, which kernels' time changed between its first row and each later one.
"""
import argparse
import ctypes
import gc
import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

import bench_step as bs  # noqa: E402  (scripts/bench_step.py)

ACCESS_POLICY_WINDOW = 1        # cudaStreamAttributeAccessPolicyWindow (cudaLaunchAttributeAccessPolicyWindow)
LIMIT_PERSISTING_L2 = 0x06      # cudaLimitPersistingL2CacheSize


def cudart():
    """The CUDA runtime torch loaded (its path from the process's mappings), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart.so" in line:
                return ctypes.CDLL(line.split()[-1])
    return None


def cuda_state(device: torch.device) -> dict:
    from srelu24_kernels.cusparselt import binding

    out = {}
    if device.type != "cuda":
        return out
    rt = cudart()
    if rt is not None:
        buf = (ctypes.c_ubyte * 64)()
        rc = rt.cudaStreamGetAttribute(ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
                                       ACCESS_POLICY_WINDOW, buf)
        base, nbytes = struct.unpack_from("QQ", bytes(buf))
        hit_ratio, hit_prop, miss_prop = struct.unpack_from("fii", bytes(buf), 16)
        out["stream_access_policy"] = {"rc": rc, "base": base, "bytes": nbytes, "hit_ratio": hit_ratio,
                                       "hit_prop": hit_prop, "miss_prop": miss_prop}
        limit = ctypes.c_size_t(0)
        out["persisting_l2_limit"] = {"rc": rt.cudaDeviceGetLimit(ctypes.byref(limit), LIMIT_PERSISTING_L2),
                                      "bytes": limit.value}
    free, total = torch.cuda.mem_get_info(device)
    out["reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
    out["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved(device)) / 2**30
    out["cslt_plans"] = sum(p is not None and p is not False for p in binding._PLANS.values())
    return out


def reset_sparse_state() -> None:
    from srelu24_kernels.cusparselt import binding

    for plan in binding._PLANS.values():
        if plan:
            plan.destroy()
    binding._PLANS.clear()
    binding._SEARCHED.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernel_changes(records: list, top: int = 12) -> list[str]:
    """For each variant profiled in more than one row: the kernels whose ms a step changed most
    between its first row and each later one (bench_step's top_kernels tables)."""
    out, first = [], {}
    for r in records:
        if "top_kernels" not in r:
            continue
        table = {name: (ms, n) for name, ms, n in r["top_kernels"]}
        if r["spec"] not in first:
            first[r["spec"]] = (r["row"], table)
            continue
        row0, base = first[r["spec"]]
        names = set(base) | set(table)
        delta = sorted(names, key=lambda k: -abs(table.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]))[:top]
        out.append(f"{r['spec']}: row {r['row']} against row {row0}, kernel busy "
                   f"{r['kernel_busy_ms_per_step']:.1f} against {records[row0]['kernel_busy_ms_per_step']:.1f} ms a step")
        for k in delta:
            (a, na), (b, nb) = base.get(k, (0, 0)), table.get(k, (0, 0))
            out.append(f"  {b - a:+8.3f} ms  ({a:.3f} x{na} -> {b:.3f} x{nb})  {k}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", required=True,
                    help="comma-separated FFN variants (each with its own overrides after colons), and `reset`")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS", help="profile each row's kernels")
    ap.add_argument("--out", type=Path, default=Path("probe_row_order.json"))
    ap.add_argument("override", nargs="*")
    args = ap.parse_intermixed_args()
    row_args = argparse.Namespace(accum=args.accum, warmup=args.warmup, steps=args.steps, layers=0, tokens="random",
                                  weights=None, weights_vocab=None, doc_len=1024, profile=args.profile, profile_host=0,
                                  energy=0.0, density=None)
    rows = args.rows.split(",")
    cfgs = {v: bs.load_config(args.override + [f"ffn={v.split(':')[0]}"] + v.split(":")[1:])
            for v in dict.fromkeys(rows) if v != "reset"}
    d = bs.setup(next(iter(cfgs.values())).trainer)
    env, records = bs.environment(), []
    print("row | ffn | ms a step | SM MHz | memory MHz | pstate | W | J a step | C | state before the row")
    for i, v in enumerate(rows):
        state = cuda_state(d.device)
        if v == "reset":
            reset_sparse_state()
            records.append({"row": i, "reset": True, "before": state, "after": cuda_state(d.device)})
            print(f"{i} | reset | | | | | | | | {json.dumps(state)} -> {json.dumps(records[-1]['after'])}", flush=True)
            continue
        with bs.inductor_settings_restored():
            r = {**bs.bench(cfgs[v], row_args, d), **bs.row_environment(env, d.device)}
        r.update(row=i, spec=v, before=state)
        records.append(r)
        c = r.get("clocks", {})
        print(f"{i} | {v} | {r['step_ms']:.1f} | {c.get('sm_clock_mhz')} | {c.get('mem_clock_mhz')} | "
              f"{','.join(c.get('pstates', [])) or None} | {c.get('power_w')} | {r.get('step_j', float('nan')):.1f} | "
              f"{c.get('temp_c')} | {json.dumps(state)}", flush=True)
    bs.shutdown(d)
    for line in kernel_changes(records):
        print(line)
    args.out.write_text(json.dumps({"argv": sys.argv, "environment": env, "rows": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
