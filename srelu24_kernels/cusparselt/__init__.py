"""cuSPARSELt: `binding` (its 2:4 GEMMs with cached plans, through ctypes) and `layout` (its sm90
compressed layout in PyTorch, the reference the sparsify kernels write)."""
