"""Layer 4, the layers and models: the configuration (:mod:`.config`), Longformer's and
Poolingformer's self-attention (:mod:`.layer`, :mod:`.pooling`), the encoder (:mod:`.model`), the task
heads (:mod:`.tasks`) and loading transformers' checkpoints into them (:mod:`.checkpoint`)."""
