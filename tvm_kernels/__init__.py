"""TVM definitions of Longformer's banded products and their ahead-of-time build.

- :mod:`tvm_kernels.compute`: the math (tensor expressions), target-independent.
- :mod:`tvm_kernels.schedules`: how each product runs, one module per target.
- :mod:`tvm_kernels.variants`: the table of targets x dtypes that gets built.
- :mod:`tvm_kernels.build`: ``make kernels``: compile everything into ``prebuilt/``.
- :mod:`tvm_kernels.cuda_toolchain`: nvcc fatbins on machines without a GPU.

Needed only to build kernels; the runtime (:mod:`longformer_ops`) never imports it.
"""
