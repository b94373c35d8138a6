"""GPU kernels, each beside a pure-PyTorch reference of the same function (tested against it)."""
