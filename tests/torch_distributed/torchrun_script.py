"""A script written for torchrun, not for mpidp: test_backend.py runs it under ``mpiexec ... python -m mpidp.torch.run``.

It calls ``init_process_group("gloo")`` as torchrun scripts do, reads the
torchrun variables, trains one DDP step and prints, per rank, what carried
its traffic. ``--fail`` raises on the last rank before the DDP step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world), (dist.get_rank(), rank)
    assert (local, local_world) == (rank, world), (local, local_world)  # one host
    assert os.environ["MASTER_ADDR"] and int(os.environ["MASTER_PORT"]) > 0
    if "--fail" in sys.argv and rank == world - 1:
        raise RuntimeError(f"failing on purpose on rank {rank}")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    model(torch.full((3, 8), float(rank))).sum().backward()
    grad = model.module.weight.grad
    expected = torch.full_like(grad, 3.0 * sum(range(world)) / world)  # the mean over ranks of 3 * rank
    assert torch.equal(grad, expected), grad
    group = dist.group.WORLD
    print(f"rank {rank} argv {sys.argv[1:]} backend {dist.get_backend()} group {type(group).__name__} "
          f"collectives {getattr(group, 'sequence', 0)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
