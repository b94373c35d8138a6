"""srelu24's weight gradients added into the weights' `.grad` by the op itself, as Megatron-LM's
gradient_accumulation_fusion does for its linears.

Under gradient accumulation autograd adds each micro-batch's weight gradient into `.grad`: the op's
unscaling pass writes dW in fp32 (270 MB for a 7B W1), then AccumulateGrad reads it and `.grad` and
writes `.grad`. With this on, the unscaling pass adds into `.grad` as it goes (fp8_sparse.unscale's
accumulate_into), which skips one write and one read of dW per weight and micro-batch, bit for bit
the same sums. The first micro-batch (`.grad` None) stores its gradient as AccumulateGrad would.

It is static: `SReLU24.grads_in_place`, which training/distributed.build_model sets for one process
(no DDP: DDP's reducer hooks AccumulateGrad, which this bypasses) and the e4m3 op on fp32 weights.
The op then hands autograd None for W1 and W2, so `torch.autograd.grad` (or `backward(inputs=...)`)
with respect to them gets nothing while their `.grad` still grows, and their post-accumulate hooks
do not fire; a training step's `loss.backward()` and the optimizer see the same `.grad` as without
it. Weights that want no gradient (requires_grad off) take the plain path.

The op is given tensors, not Parameters: `register(params)` records the model's parameters (weakly),
and `parameter_of(w)` finds the one whose storage w is (rebuilt on a miss: a parameter moved by
`.to()` has a new address).
"""
import weakref

import torch
from torch import Tensor, nn

_registered: list = []   # weakrefs to the parameters
_by_address: dict = {}   # (data_ptr, shape) -> weakref


def register(params) -> None:
    """Record `params` (nn.Parameters) as those whose gradients the op may add into."""
    for p in params:
        if not any(r() is p for r in _registered):
            _registered.append(weakref.ref(p))
    _by_address.clear()


def _key(t: Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape)


def parameter_of(w: Tensor) -> nn.Parameter:
    """The registered parameter whose storage w is; RuntimeError if none."""
    ref = _by_address.get(_key(w))
    p = ref() if ref is not None else None
    if p is None or _key(p) != _key(w):
        _registered[:] = [r for r in _registered if r() is not None]
        _by_address.clear()
        _by_address.update({_key(r()): r for r in _registered})
        ref = _by_address.get(_key(w))
        p = ref() if ref is not None else None
    if p is None:
        raise RuntimeError(f"srelu24 with grads_in_place: no registered parameter holds this {tuple(w.shape)} weight "
                           "(kernels.grads_in_place.register(model.parameters()), which build_model does)")
    return p


def accumulator(p: nn.Parameter) -> Tensor | None:
    """p.grad where a kernel may add into it (contiguous, p's dtype and shape), else None: then the
    gradient is computed apart and `add` stores or adds it."""
    g = p.grad
    if g is None or g.dtype != p.dtype or g.shape != p.shape or not g.is_contiguous():
        return None
    return g


@torch.no_grad()
def add(p: nn.Parameter, dw: Tensor) -> None:
    """p.grad += dw, or p.grad = dw where there is none yet (as AccumulateGrad, which keeps the
    gradient itself where its layout is the parameter's)."""
    if p.grad is None:
        p.grad = dw if dw.stride() == p.stride() else dw.contiguous()
    else:
        p.grad += dw
