"""Paired A/B of two mpidp sessions' reduce windows: two revisions, two reduction modes, or both.

Side A (the base) is mpidp at git revision ``--rev`` (extracted with ``git
archive`` into a folder of each rank's own and imported under another name,
beside the installed mpidp), or this checkout when ``--rev`` is not given.
Side B is always this checkout. ``--base-reduction`` and ``--reduction`` set
``MPIDP_REDUCTION`` for A and B (by default each side reads the
environment, where unset means ``auto``). For each gradient set, mix
and kind (``gradient_buffers`` or caller arrays) both sessions are
initialized on the same parameters and their reduce windows alternate (which
goes first alternates too); each pair gives one ratio, B / A (below 1: B is
faster), so load changes on a shared machine cancel, and both sessions'
memory lives in the same process. Prints the median ratio with its range;
``--out`` writes the rows as JSON::

    # this checkout against an earlier revision (both on the auto rule)
    mpiexec -n 2 python -m mpi4py benchmarks/versus.py --rev 5fe2b74 --sets tiny,resnet50
    # the two host reductions of this checkout against each other
    mpiexec -n 4 python -m mpi4py benchmarks/versus.py --base-reduction allreduce --reduction reduce_scatter --sets gpt2 --mixes fp32

On a virtual machine, ``NUMPY_MADVISE_HUGEPAGE=0`` keeps every buffer on
small pages: whether NumPy's large arrays get transparent huge pages varies
from allocation to allocation there, and moved single timings up to 3x
(benchmarks/results/NOTES.md). The revision's package must import its own
modules relatively (``from . import``), as mpidp always has.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradsets

import mpidp

COMM = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parent.parent
#: an absolute import of mpidp inside the package would load this checkout's module instead of the revision's
ABSOLUTE = re.compile(r"^\s*(from\s+mpidp[\s.]|import\s+mpidp\b)", re.MULTILINE)
REDUCTIONS = ("auto", "allreduce", "reduce_scatter")
#: a session under test: (its DataParallel, the gradients it reduces every window)
Session = tuple[Any, dict[str, Any]]


def extract(rev: str, into: Path) -> ModuleType:
    """Import revision ``rev``'s mpidp package, extracted under ``into``, as a module of another name (local)."""
    try:
        data = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "mpidp"], check=True, capture_output=True, timeout=120
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        raise SystemExit(f"versus: cannot read mpidp at {rev!r} with git archive: {err.decode().strip() or e}") from e
    name = "mpidp_" + re.sub(r"\W", "_", rev)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.10.12 / 3.11.4 on
            tar.extractall(into, filter="data")
        else:  # pragma: no cover - older patch releases: git's own archive of a revision
            tar.extractall(into)
    (into / "mpidp").rename(into / name)
    for py in (into / name).glob("*.py"):  # the library's modules (examples/ are scripts, never imported by them)
        found = ABSOLUTE.search(py.read_text())
        if found:
            raise SystemExit(f"versus: {py.name} at {rev} imports mpidp absolutely ({found.group(0).strip()!r}); cannot load it beside this checkout")
    sys.path.insert(0, str(into))
    return __import__(name)


def window(dp: Any, grads: dict[str, Any]) -> float:
    """One reduce window from the same values; the slowest rank's seconds (collective)."""
    for g in grads.values():
        g.fill(1.0 + COMM.rank / 8)
    COMM.Barrier()
    t0 = time.perf_counter()
    dp.reduce(grads, 1 + (COMM.rank == 0))
    return float(COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX))


def alternate(base: Session, other: Session, reps: int, warmup: int = 2) -> dict[str, Any]:
    """``reps`` pairs of windows (collective): the median of other / base, its range, both median times."""
    for _ in range(warmup):  # first touch, the kept plans and programs
        window(*base)
        window(*other)
    ratios, before, now = [], [], []
    for r in range(reps):
        if r % 2 == 0:
            b = window(*base)
            o = window(*other)
        else:
            o = window(*other)
            b = window(*base)
        ratios.append(o / b)
        before.append(b)
        now.append(o)
    return {
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "base_seconds": statistics.median(before), "other_seconds": statistics.median(now),
    }


def session(module: ModuleType, reduction: str | None, params: dict[str, Any], kind: str) -> Session:
    """One side's session and its gradients, under ``MPIDP_REDUCTION=reduction`` (None: the environment's)."""
    before = os.environ.get("MPIDP_REDUCTION")
    if reduction is not None:
        os.environ["MPIDP_REDUCTION"] = reduction  # read by initialize, alike on every rank
    try:
        dp = module.DataParallel.initialize(params, COMM)
    finally:
        if before is None:
            os.environ.pop("MPIDP_REDUCTION", None)
        else:
            os.environ["MPIDP_REDUCTION"] = before
    grads = dp.gradient_buffers() if kind == "buffers" else {n: np.empty(a.shape, a.dtype) for n, a in params.items()}
    return dp, grads


def compare(base: ModuleType, a: argparse.Namespace, name: str, mix: str, kind: str) -> dict[str, Any]:
    """Median ratio (B / A) of ``a.reps`` pairs of windows (collective)."""
    _, layout = gradsets.shapes(name)
    params = {n: np.zeros(s, gradsets.dtype_of(mix, s)) for n, s in layout}
    sides = [session(base, a.base_reduction, params, kind), session(mpidp, a.reduction, params, kind)]
    try:
        res = alternate(sides[0], sides[1], a.reps)
    finally:
        for dp, _ in sides:
            dp.close()
    return {
        "set": name, "mix": mix, "kind": kind, "ratio": res["ratio"], "ratio_min": res["ratio_min"],
        "ratio_max": res["ratio_max"], "base_seconds": res["base_seconds"], "checkout_seconds": res["other_seconds"],
    }


def use_casts(casts: str) -> None:
    """This checkout's 16-bit casts (the revision's own switches are left as they are)."""
    if casts == "torch":
        import torch

        torch.set_num_threads(1)  # one core per rank, as for MPI
    else:
        os.environ["MPIDP_CASTS"] = casts  # read by initialize (this checkout's sessions; an older mpidp ignores it)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default=None, help="side A: mpidp at this git revision (a commit, tag or branch); default: this checkout")
    p.add_argument("--base-reduction", default=None, choices=REDUCTIONS, help="MPIDP_REDUCTION of side A (default: the environment's)")
    p.add_argument("--reduction", default=None, choices=REDUCTIONS, help="MPIDP_REDUCTION of side B (default: the environment's)")
    p.add_argument("--sets", default="tiny,resnet50,gpt2", help="comma-separated gradient sets (default: tiny,resnet50,gpt2)")
    p.add_argument("--mixes", default="fp32,mixed", help="comma-separated mixes of fp32, mixed, fp16 (default fp32,mixed)")
    p.add_argument("--kinds", default="buffers,arrays", help="gradient_buffers (buffers) and/or caller arrays (arrays)")
    p.add_argument("--casts", default="torch", choices=("torch", "numba", "numpy"),
                   help="16-bit casts of this checkout: torch's (imports torch), mpidp.kernels' (numba) or NumPy's "
                        "(a revision's own switches are left as they are)")
    p.add_argument("--reps", type=int, default=15, help="pairs of windows per row (default 15)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON to this file")
    a = p.parse_args(argv)
    for value, allowed, flag in ((a.sets, gradsets.SETS, "--sets"), (a.mixes, gradsets.MIXES, "--mixes"), (a.kinds, ("buffers", "arrays"), "--kinds")):
        bad = [x for x in value.split(",") if x not in allowed]
        if bad:
            p.error(f"{flag}: {', '.join(bad)} not among {', '.join(allowed)}")
    if a.rev is None and a.base_reduction == a.reduction:
        p.error("nothing to compare: give --rev, or a --base-reduction other than --reduction")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    base_name = f"mpidp at {a.rev}" if a.rev else "this checkout"
    title = f"this checkout{f' ({a.reduction})' if a.reduction else ''} / {base_name}{f' ({a.base_reduction})' if a.base_reduction else ''}"
    with tempfile.TemporaryDirectory(prefix="mpidp-versus-") as tmp:
        base = extract(a.rev, Path(tmp)) if a.rev else mpidp
        use_casts(a.casts)  # after the revision is read: a bad --rev fails without importing torch
        rows = []
        if COMM.rank == 0:
            print(f"{title}, {COMM.size} ranks, {a.casts} casts, median of {a.reps} paired windows")
            print(f"  {'set':9} {'mix':6} {'kind':8} {'ratio':>7} {'min-max':>11} {'A ms':>10} {'B ms':>10}")
        for name in a.sets.split(","):
            for mix in a.mixes.split(","):
                for kind in a.kinds.split(","):
                    row = compare(base, a, name, mix, kind)
                    rows.append(row)
                    if COMM.rank == 0:
                        print(f"  {name:9} {mix:6} {kind:8} {row['ratio']:6.3f}x {row['ratio_min']:5.2f}-{row['ratio_max']:<5.2f} "
                              f"{row['base_seconds'] * 1e3:10.3f} {row['checkout_seconds'] * 1e3:10.3f}", flush=True)
    if a.out is not None and COMM.rank == 0:
        meta = {"rev": a.rev, "base_reduction": a.base_reduction, "reduction": a.reduction, "world_size": COMM.size,
                "casts": a.casts, "reps": a.reps, "command": " ".join(["benchmarks/versus.py", *sys.argv[1:]])}
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
