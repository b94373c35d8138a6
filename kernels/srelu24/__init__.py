"""The srelu24 FFN: its PyTorch reference, its options, the custom op and its sparsify passes
(the map is in kernels/__init__.py)."""
