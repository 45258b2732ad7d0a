"""Ray actors of a megaray run (imported as ``megaray.actors``).

ParameterStore owns the shared-memory files (masters, the compute copy, the gradient ring,
the control words); GpuWorker streams layer units through the GPU (or the CPU) and ships
gradients through the ring; each OptimizerShard updates the gradient pieces assigned to it
(interleaved over the model by default), in place, as each piece's gradient arrives;
Scheduler issues one call per actor per step and collects them, off the per-layer path (the
worker and the shards order themselves through ``megaray.protocol``'s control words);
DataFeeder builds batches ahead; WeightRelay serves workers on other nodes. The driver's
``megaray.driver.session.TrainingSession`` starts and stops them all.
"""
