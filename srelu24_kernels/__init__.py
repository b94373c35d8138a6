"""GPU kernels, each beside a pure-PyTorch reference of the same function (tested against it).

Grouped by job:

    srelu24/     the srelu24 FFN op
      reference.py          the method in PyTorch: the definition every kernel is tested against
      options.py            the op's options (OpOptions) and an optimizer step's state (StepState)
      op.py                 the custom op: forward and backward, GEMM by GEMM
      sparsify.py           forward pass: srelu + 2:4 + compress (Triton; CUDA C++ where built)
      sparsify_backward.py  backward pass: the three sparse operands from one read
      native.py, csrc/      the CUDA C++ versions (`make kernels`) and their loader
    cusparselt/  cuSPARSELt
      binding.py            its 2:4 GEMM with cached plans (ctypes)
      layout.py             its sm90 compressed layout in PyTorch; the row and column padding
    float8/      float8 casts and GEMMs (trainer.float8)
      cast.py               scaled casts in one pass
      gemm.py               the op's dense GEMMs, scaled as torchao scales
      sparse.py             the op's 2:4 GEMMs in e4m3
    ffn_stats.py the activation statistics of every FFN

Who calls whom, for srelu24 in its 2:4 phase (model/ffn.py -> srelu24/op.py):

    op.ffn_forward   float8/gemm (Z, in float8) or torch (bf16) -> srelu24/sparsify (A24)
    op.ffn_output    cusparselt/binding (Y; through float8/sparse in e4m3)
    op.ffn_backward  float8/gemm or torch (dA) -> srelu24/sparsify_backward -> cusparselt/binding
                     (dX, dW1, dW2; through float8/sparse in e4m3)
"""
