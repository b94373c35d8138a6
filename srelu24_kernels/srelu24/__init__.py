"""The srelu24 FFN: its PyTorch reference, its options, the custom op and its sparsify passes
(the map is in srelu24_kernels/__init__.py)."""
