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
