"""A torchrun script on simulated hosts: tests/test_multihost.py runs it under ``python -m mpidp.torch.run``.

It asks for ``"gloo"`` as torchrun scripts do (the launcher keeps its ``"mpidp"`` group), trains one DDP step,
all-gathers the gradient and all-reduces 4 MiB, and prints per rank what the launcher set and whether every rank
holds the same gradient and the exact sum.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 64))
    model(torch.full((3, 256), float(rank))).sum().backward()
    grad = model.module.weight.grad.clone()
    every = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(every, grad)
    t = torch.arange(1 << 20, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    ok = all(torch.equal(e, grad) for e in every) and torch.equal(t, torch.arange(1 << 20, dtype=torch.float32) * (world * (world + 1) // 2))
    print(f"rank {rank}/{world} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} host {socket.gethostname()} "
          f"master {os.environ['MASTER_ADDR']} backend {dist.get_backend()} ok {ok}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
