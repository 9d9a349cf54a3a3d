"""Layer 3, the encoder's building blocks: the dense products in the half types (:mod:`.dense`), the
fused bias + GELU (:mod:`.gelu`), layer norm (:mod:`.layer_norm`) and bias + dropout + residual
(:mod:`.residual`). Built on :mod:`longformer_ops.ops` and :mod:`longformer_ops.runtime`."""
