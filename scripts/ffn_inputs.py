"""The FFN shapes the benchmark scripts time, and their random bf16 inputs on the GPU."""
import torch

SHAPES = {"1B": (2048, 8192), "7B": (4096, 16384)}  # name -> (d, hidden F)


def ffn_inputs(D: int, Fh: int, T: int, requires_grad: bool = False):
    """x [T, D], dY [T, D], W1 [Fh, D], W2 [D, Fh] in bf16 on the current GPU, the weights scaled by
    1/sqrt(fan-in); requires_grad: x, W1 and W2 are leaves that take gradients."""
    bf = torch.bfloat16
    x, dy = torch.randn(T, D, device="cuda", dtype=bf), torch.randn(T, D, device="cuda", dtype=bf)
    w1 = torch.randn(Fh, D, device="cuda", dtype=bf) * D ** -0.5
    w2 = torch.randn(D, Fh, device="cuda", dtype=bf) * Fh ** -0.5
    if requires_grad:
        for t in (x, w1, w2):
            t.requires_grad_()
    return x, dy, w1, w2
