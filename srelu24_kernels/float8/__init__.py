"""float8 for srelu24's own GEMMs: `cast` (scaled casts in one pass), `gemm` (the dense GEMMs, scaled as
torchao's recipes scale the Float8Linear modules around them), `sparse` (cuSPARSELt's e4m3 2:4 GEMMs)."""


def scaled_mm_shapes(*dims: int) -> bool:
    """torch._scaled_mm takes operands whose dimensions are all multiples of 16."""
    return all(d % 16 == 0 for d in dims)
