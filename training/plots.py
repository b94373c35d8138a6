"""Figures shared by the wandb logger and scripts/compare.py (matplotlib, no display)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def layer_heatmap(tokens: list[int], values: list[list[float]], title: str, label: str = "act_sparsity"):
    """Layers x training progress: values[i][layer] measured at tokens[i]."""
    v = np.asarray(values, dtype=float).T  # [layers, logs]
    fig, ax = plt.subplots(figsize=(7, 0.25 * v.shape[0] + 2))
    extent = (tokens[0], tokens[-1], v.shape[0] - 0.5, -0.5) if len(tokens) > 1 else None
    im = ax.imshow(v, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1, extent=extent)
    ax.set_xlabel("tokens")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    return fig


def close(fig) -> None:
    plt.close(fig)


BREAKDOWN_GROUPS = (("dense GEMMs", "(dense)"), ("sparse GEMMs", "(sparse)"), ("sparsify passes", "fused"),
                    ("dense-feature GEMMs", "dense-feature"), ("permute, gather, other", ""))


def ffn_breakdown(breakdown: dict, fwbw: dict):
    """Where srelu24's fw+bw time goes, per shape: its pieces (scripts/bench_ffn.py) stacked by
    kind, beside dense srelu's fw+bw (eager and compiled) at the same shape where measured.
    breakdown: {shape name: {piece: ms}}; fwbw: {shape name: bench_ffn fwbw row}."""
    names = list(breakdown)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.9 * len(names) + 0.6), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, name in zip(axes[:, 0], names):
        groups = {g: 0.0 for g, _ in BREAKDOWN_GROUPS}
        for piece, ms in breakdown[name].items():
            group = next(g for g, key in BREAKDOWN_GROUPS if key in piece)
            groups[group] += ms
        rows = [("srelu24 pieces, each timed alone", groups)]
        r = fwbw.get(name)
        if r:
            rows += [("srelu24 measured", {"srelu24": r["fwbw_srelu24_ms"]}),
                     ("dense srelu compiled", {"dense": r["fwbw_dense_compiled_ms"]}),
                     ("dense srelu eager", {"dense": r["fwbw_dense_eager_ms"]})]
        for y, (label, parts) in enumerate(rows):
            left = 0.0
            for i, (g, ms) in enumerate(parts.items()):
                color = colors[i] if y == 0 else "0.6"
                ax.barh(y, ms, left=left, color=color, label=g if y == 0 else None)
                left += ms
            ax.text(left, y, f" {left:.2f} ms", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [lbl for lbl, _ in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
    axes[-1, 0].set_xlabel("ms per forward + backward")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, ncol=len(labels), loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


# A profiled kernel's category in a training step (first match wins), for step_kernels.
KERNEL_CATEGORIES = [
    ("2:4 sparse GEMMs", ("sparse_gemm",)),
    ("dense GEMMs", ("nvjet", "gemm", "cutlass")),
    ("attention", ("sdpa", "flash", "cudnn")),
    ("optimizer", ("multi_tensor_apply",)),
    ("srelu24 kernels", ("srelu_sparsify", "backward_operands", "_dense_columns", "_dense_rows")),
    # torch's own: srelu24's permutation, gathers and feature sort, and the embedding backward's
    ("sort, gather, index", ("radix_sort", "randperm", "gather", "index_elementwise", "fill_reverse_indices")),
    ("fused elementwise (Inductor)", ("triton_",)),
]


def kernel_category(name: str) -> str:
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in name for k in keys)), "other")


def step_kernels(results: list[dict]):
    """Profiled GPU kernel time per training step by category, one bar per FFN variant
    (scripts/bench_step.py --profile), labelled with the step time and the SM clock it ran at.
    results: bench_step result rows with "top_kernels" ([name, ms per step, launches])."""
    rows = [r for r in results if r.get("top_kernels")]
    cats = [c for c, _ in KERNEL_CATEGORIES] + ["other"]
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(rows) + 1.6))
    colors = plt.get_cmap("tab10").colors
    for y, r in enumerate(rows):
        sums = dict.fromkeys(cats, 0.0)
        for name, ms, _ in r["top_kernels"]:
            sums[kernel_category(name)] += ms
        left = 0.0
        for i, c in enumerate(cats):
            ax.barh(y, sums[c], left=left, color=colors[i % len(colors)], label=c if y == 0 else None)
            left += sums[c]
        clock = r.get("clocks", {}).get("sm_clock_mhz")
        ax.text(left, y, f" {r['step_ms']:.1f} ms step" + (f", SM {clock:.0f} MHz" if clock else ""),
                va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{r['ffn']} {r['precision']}" if r.get("precision") else r["ffn"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
    ax.set_xlabel("GPU kernel time per step (ms, profiled)")
    if rows:
        r0 = rows[0]
        ax.set_title(f"{r0['model']}, {r0['n_layers']} layers, micro-batch {r0['micro_batch']} x {r0['seq_len']}",
                     fontsize=9)
    fig.legend(fontsize=8, ncol=4, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig
