"""``mpiexec -n N python -m mpidp.torch.run [-m module | script.py] [args]``: a torchrun script under MPI, over ``"mpidp"``.

Sets the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) from MPI, registers
the ``"mpidp"`` backend, initializes the default process group with it and
runs the script as ``__main__``. A later ``init_process_group`` call of the
script (whatever backend it names) returns at once and leaves the ``"mpidp"``
group in place, so that scripts written for torchrun run unmodified. An
uncaught exception or a non-zero ``sys.exit`` on any rank prints its
traceback and aborts the whole job, as under ``python -m mpi4py``, instead
of leaving the other ranks waiting in a collective.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import comm as _mpi
from .. import guard
from .distributed import BACKEND, ProcessGroupMPIDP, torchrun_environment

__all__ = ["main"]

USAGE = "usage: mpiexec -n N python -m mpidp.torch.run [--no-init] [--report] (-m module | script.py) [args ...]"


def _parse(argv: list[str]) -> tuple[set[str], str | None, str, list[str]]:
    """(the launcher's flags, module or None, module or script path, the script's arguments); SystemExit(2) on bad use."""
    flags = set()
    while argv[:1] in (["--no-init"], ["--report"]):
        flags.add(argv.pop(0))
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if argv[:1] == ["-m"] and len(argv) >= 2:
        return flags, argv[1], argv[1], argv[2:]
    if argv and not argv[0].startswith("-"):
        return flags, None, argv[0], argv[1:]
    sys.stderr.write(f"{USAGE}\n")
    raise SystemExit(2)


def _keep_group(original: Callable[..., Any]) -> Callable[..., Any]:
    """``init_process_group`` that returns at once while a default group exists (the launcher's)."""
    told: list[bool] = []

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            return original(backend, *args, **kwargs)
        if not told and dist.get_rank() == 0 and backend not in (None, BACKEND):
            sys.stderr.write(f"mpidp.torch.run: init_process_group({backend!r}) kept the launcher's {BACKEND!r} group\n")
            told.append(True)
        return None

    return init_process_group


def main(argv: list[str] | None = None) -> None:
    """Run the script or module of ``argv`` (default ``sys.argv[1:]``) as torchrun would, over the ``"mpidp"`` backend (collective)."""
    flags, module, target, rest = _parse(list(sys.argv[1:] if argv is None else argv))
    rank = _mpi.world().rank
    try:  # not sys.excepthook: torch's, installed by init_process_group, holds stderr while the hooks it wraps run
        _start(flags)
        sys.argv = [target, *rest]
        _run(module, target)
    except SystemExit as e:
        if e.code not in (None, 0):
            sys.stderr.write(f"mpidp.torch.run: rank {rank} exited with {e.code!r}; aborting the MPI job\n")
            sys.stderr.flush()
            _mpi.abort(e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException as e:  # noqa: BLE001 - every failure ends the job, KeyboardInterrupt too
        guard.fatal(rank, f"mpidp.torch.run {target}", e)
    finally:
        if "--report" in flags:
            print(f"mpidp.torch.run: rank {rank}: {ProcessGroupMPIDP.carried} operations over {BACKEND!r}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _start(flags: set[str]) -> None:
    """Set torchrun's variables from MPI and (unless ``--no-init``) make the default group over ``"mpidp"`` (collective)."""
    os.environ.update(torchrun_environment())
    if not torch.cuda.is_available():  # as `accelerate launch` does where there is no GPU: Accelerate's multi-CPU mode
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    if "--no-init" not in flags:
        dist.init_process_group(BACKEND)
        dist.init_process_group = _keep_group(dist.init_process_group)


def _run(module: str | None, target: str) -> None:
    """Run ``module`` (or the script at ``target``) as ``__main__``."""
    if module is not None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
