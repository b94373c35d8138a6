"""In-process A/B of two implementations of one module attribute (the lab's probe_*_ab.py): the
same run timed with each in interleaved rounds (scripts/bench_ffn.interleaved_rounds: the order
reversed every other round, so both share the GPU's drift at the power cap), printed as medians,
every round, and the per-round ratio of the first variant's time to the second's."""
import statistics

from scripts.bench_ffn import interleaved_rounds


def patched_grads(module, attr: str, variants: dict, run, grads) -> dict:
    """{variant: grads()} after one run with `module.attr` set to each variant's implementation."""
    out = {}
    for v, impl in variants.items():
        setattr(module, attr, impl)
        run()
        out[v] = grads()
    return out


def patched_ab(module, attr: str, variants: dict, run, rounds: int, timer, label: str = "FFN fw+bw") -> dict:
    """{variant: [ms of each round]}, `module.attr` set to the variant's implementation while it is
    timed; afterwards to the last variant's (the new one)."""
    def with_impl(impl):
        def timed():
            setattr(module, attr, impl)
            run()
        return timed

    times = interleaved_rounds({v: with_impl(impl) for v, impl in variants.items()}, rounds, timer)
    setattr(module, attr, list(variants.values())[-1])
    for v, ms in times.items():
        print(f"{label}, {v}: median {statistics.median(ms):.3f} ms; rounds " + ", ".join(f"{t:.3f}" for t in ms))
    ratios = [a / b for a, b in zip(*times.values())]
    print(f"first / second per round: median {statistics.median(ratios):.4f}x; " + ", ".join(f"{r:.4f}" for r in ratios))
    return times


def fp32_7b_ffn_inputs(tokens: int):
    """(x, dY, W1, W2) at the 7B FFN's shapes (d 4096, F 16512) on the GPU, the weights as fp32
    leaves (the parameters on one GPU), x a bf16 leaf: what the e4m3 op's A/B probes run on."""
    from scripts.ffn_inputs import SHAPES, ffn_inputs

    D, Fh = SHAPES["7B-config"][:2]
    x, gy, w1, w2 = ffn_inputs(D, Fh, tokens)
    return x.requires_grad_(), gy, *(w.float().requires_grad_() for w in (w1, w2))
