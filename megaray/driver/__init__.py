"""The driver: what runs in the process that ``megaray train`` (or ``ray job submit``, a
bench, a test) starts, above the actors.

- ``runner``: the training loop, its stop and restart rules (``train``);
- ``session``: spawning every actor of a run, driving it, and tearing it down;
- ``runlog``: the run directory a person reads (log, metrics.jsonl, TensorBoard, summary);
- ``cluster``: the Ray the driver runs on (connect, or start a local one).
"""
