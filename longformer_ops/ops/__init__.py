"""Layer 2, the functions: ``diagonaled_mm``, ``mask_invalid_locations``, ``band_softmax_``
(:mod:`.diagonaled`), ``sliding_window_attention`` (:mod:`.attention`), the attention's dropout
(:mod:`.dropout`), and their plain-PyTorch references (:mod:`.reference`), the spec every kernel is
tested against. Built on :mod:`longformer_ops.runtime` only."""
