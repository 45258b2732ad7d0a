"""Ray actors of a megaray run (imported as ``megaray.actors``).

ParameterStore owns the shared-memory buffers; OptimizerShard updates a contiguous range of
layer units in place; GpuWorker streams layers through the GPU (or the CPU); Scheduler
drives steps and routes gradients; ``session.TrainingSession`` starts and stops them all.
"""
