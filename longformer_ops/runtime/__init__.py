"""Layer 1, the runtime: prebuilt kernel libraries found, checked and loaded (:mod:`.manifest`,
:mod:`.loader`), and registered as the ``torch.library`` custom ops ``torch.ops.longformer_ops.*``
(:mod:`.kernels`). Also the input checks, the band's geometry and the recycled output memory that
every layer above shares. Imports nothing of the layers above, and never ``tvm_kernels``."""
