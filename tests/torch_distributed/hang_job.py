"""Rank 0 all-reduces, rank 1 never does: the watchdog's report, then an abort (run by test_backend.py, 2 ranks)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mpidp.torch.distributed  # noqa: F401 - registers "mpidp"

dist.init_process_group("mpidp", timeout=timedelta(seconds=2))
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(3))
else:
    time.sleep(60)
print(f"rank {dist.get_rank()} returned", flush=True)
