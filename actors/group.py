"""Data-parallel workers (``worker.count``): one process group, gradients and loss summed.

Every rank computes its share of a step's micro-batches; before the global norm each unit's
fp32 gradient and the loss are all-reduced (NCCL on GPUs, gloo on the CPU), so every rank
holds the whole step's sum and rank 0 alone decides the step and ships it.
"""
from __future__ import annotations

import datetime
import socket

import ray
import torch
import torch.distributed as dist

from .device import Device


class DataParallelGroup:
    def __init__(self, rank: int, world: int, dev: Device, timeout_s: float):
        self.rank, self.world, self.dev, self.timeout_s = rank, world, dev, timeout_s

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: an address and a free port of this node for the workers' process group."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, addr: str, port: int) -> None:
        """Join the process group; every rank calls this at once."""
        dist.init_process_group("nccl" if self.dev.cuda else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        probe = torch.ones(1, device=self.dev.device)
        dist.all_reduce(probe)                      # the group works before the first step needs it
        if int(probe.item()) != self.world:
            raise RuntimeError(f"process group all-reduce gave {probe.item()}, expected {self.world}")

    def sum(self, grads: list, loss_sum: torch.Tensor | None = None) -> None:
        """Sum gradients (and the loss) over the workers, in place."""
        for g in grads:
            dist.all_reduce(g)
        if loss_sum is not None:
            dist.all_reduce(loss_sum)
