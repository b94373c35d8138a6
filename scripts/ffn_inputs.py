"""The FFN shapes the benchmark scripts time, and their random bf16 inputs on the GPU."""
from statistics import NormalDist

import torch

# name -> (d, hidden F): the round shapes, and the model configs' srelu hidden sizes
# (1.5x SwiGLU's, rounded to 128: configs/model/1b.yaml, 7b.yaml)
SHAPES = {"1B": (2048, 8192), "7B": (4096, 16384), "1B-config": (2048, 8448), "7B-config": (4096, 16512)}


def ffn_inputs(D: int, Fh: int, T: int, requires_grad: bool = False, density: float | None = None,
               device: str = "cuda"):
    """x [T, D], dY [T, D], W1 [Fh, D], W2 [D, Fh] in bf16 on the current GPU, the weights scaled by
    1/sqrt(fan-in), so that Z = X W1^T is about N(0, 1): half its entries positive, as at init.
    density: the fraction of Z above zero instead, for activations as sparse as a trained model's
    (84-98% zeros after srelu, docs/METHOD.md, 2:4 activation sparsity). X's last column becomes a constant 1 and
    W1's last column -q, so Z is about N(-q, 1) with P(Z > 0) = density for every feature.
    requires_grad: x, W1 and W2 are leaves that take gradients. device: the GPU by default."""
    bf = torch.bfloat16
    x, dy = torch.randn(T, D, device=device, dtype=bf), torch.randn(T, D, device=device, dtype=bf)
    w1 = torch.randn(Fh, D, device=device, dtype=bf) * D ** -0.5
    w2 = torch.randn(D, Fh, device=device, dtype=bf) * Fh ** -0.5
    if density is not None:
        if not 0.0 < density < 1.0:
            raise ValueError(f"density is the fraction of positive pre-activations, in (0, 1); got {density}")
        x[:, -1] = 1.0
        w1[:, -1] = -NormalDist().inv_cdf(1.0 - density)
    if requires_grad:
        for t in (x, w1, w2):
            t.requires_grad_()
    return x, dy, w1, w2


def swiglu_weights(D: int, Fh: int, requires_grad: bool = False, device: str = "cuda"):
    """SwiGLU's W1, W3 [Fg, D] and W2 [D, Fg] with the parameter count of srelu's hidden size Fh
    (Fg = 2/3 Fh, rounded down to 256), scaled as ffn_inputs scales srelu's."""
    bf = torch.bfloat16
    Fg = (2 * Fh) // 3 // 256 * 256
    ws = [torch.randn(Fg, D, device=device, dtype=bf) * D ** -0.5 for _ in range(2)]
    ws.append(torch.randn(D, Fg, device=device, dtype=bf) * Fg ** -0.5)
    if requires_grad:
        for t in ws:
            t.requires_grad_()
    return ws
