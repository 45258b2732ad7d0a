"""Measurements: ``megaray bench`` and what it runs (the driver's side, above the actors).

- ``run``: megaray against the GPU-resident baseline of the same model and batches, in one
  process tree, with where megaray's time went;
- ``baseline``: that baseline, an ordinary nn.Module with every weight on the device;
- ``adamw``: the CPU AdamW alone, every state combination, over processes and threads (and
  the random state the start-up calibration of the shards' rate updates);
- ``attention`` and ``block``: one attention layer, one decoder block, alone on the GPU.
"""
