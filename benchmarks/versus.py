"""Paired A/B of this checkout's reduce against an earlier revision's, in one process.

Every rank extracts the ``mpidp`` package of git revision ``--rev`` (with
``git archive``) into a folder of its own and imports it under another
name, beside the installed mpidp. For each gradient set, mix and kind
(``gradient_buffers`` or caller arrays) both sessions are initialized on
the same parameters, and their reduce windows alternate (which goes first
alternates too); the ratio of each pair is taken (this checkout / the
revision: below 1, this checkout is faster), so load changes on a shared
machine cancel and both sessions' memory lives in the same process. It
prints the median ratio with its range, and with ``--out`` writes them as JSON::

    mpiexec -n 2 python -m mpi4py benchmarks/versus.py --rev 5fe2b74 --sets tiny,resnet50
    NUMPY_MADVISE_HUGEPAGE=0 mpiexec -n 4 python -m mpi4py benchmarks/versus.py --rev v0.1.0 --casts numpy

On a virtual machine, ``NUMPY_MADVISE_HUGEPAGE=0`` keeps every buffer on
small pages: whether NumPy's large arrays get transparent huge pages varies
from allocation to allocation there, and moved single timings up to 3x
(docs/performance.md). The revision's package must import its own modules
relatively (``from . import``), as mpidp always has.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradsets
import pairs

import mpidp

COMM = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parent.parent
#: an absolute import of mpidp inside the package would load this checkout's module instead of the revision's
ABSOLUTE = re.compile(r"^\s*(from\s+mpidp[\s.]|import\s+mpidp\b)", re.MULTILINE)


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


def compare(old: ModuleType, name: str, mix: str, kind: str, reps: int) -> dict[str, Any]:
    """Median ratio (this checkout / the revision) of ``reps`` pairs of windows (collective)."""
    _, layout = gradsets.shapes(name)
    params = {n: np.zeros(s, gradsets.dtype_of(mix, s)) for n, s in layout}
    sessions: dict[str, tuple[Any, dict[str, Any]]] = {}
    for tag, module in (("revision", old), ("checkout", mpidp)):
        dp = module.DataParallel.initialize(params, COMM)
        grads = dp.gradient_buffers() if kind == "buffers" else {n: np.empty(s, gradsets.dtype_of(mix, s)) for n, s in layout}
        sessions[tag] = (dp, grads)
    try:
        res = pairs.alternate(sessions["revision"], sessions["checkout"], reps, warmup=2)
    finally:
        for dp, _ in sessions.values():
            dp.close()
    return {
        "set": name, "mix": mix, "kind": kind, "ratio": res["ratio"], "ratio_min": res["ratio_min"],
        "ratio_max": res["ratio_max"], "revision_seconds": res["base_seconds"], "checkout_seconds": res["other_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="the git revision to compare with (a commit, tag or branch)")
    p.add_argument("--sets", default="tiny,resnet50,gpt2", help="comma-separated gradient sets (default: tiny,resnet50,gpt2)")
    p.add_argument("--mixes", default="fp32,mixed", help="comma-separated mixes of fp32, mixed, fp16 (default fp32,mixed)")
    p.add_argument("--kinds", default="buffers,arrays", help="gradient_buffers (buffers) and/or caller arrays (arrays)")
    p.add_argument("--casts", default="torch", choices=("torch", "numba", "numpy"),
                   help="16-bit casts of this checkout: torch's (imports torch), mpidp.kernels' (numba) or NumPy's "
                        "(the revision's own switches are left as they are)")
    p.add_argument("--reps", type=int, default=15, help="pairs of windows per row (default 15)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON to this file")
    a = p.parse_args(argv)
    for value, allowed, flag in ((a.sets, gradsets.SETS, "--sets"), (a.mixes, gradsets.MIXES, "--mixes"), (a.kinds, ("buffers", "arrays"), "--kinds")):
        bad = [x for x in value.split(",") if x not in allowed]
        if bad:
            p.error(f"{flag}: {', '.join(bad)} not among {', '.join(allowed)}")
    if a.casts == "torch":
        import torch

        torch.set_num_threads(1)  # one core per rank, as for MPI
    else:
        os.environ["MPIDP_CASTS"] = a.casts  # read by initialize (this checkout's sessions; an older mpidp ignores it)
    with tempfile.TemporaryDirectory(prefix="mpidp-versus-") as tmp:
        old = extract(a.rev, Path(tmp))
        rows = []
        if COMM.rank == 0:
            print(f"this checkout / mpidp at {a.rev}, {COMM.size} ranks, {a.casts} casts, median of {a.reps} paired windows")
            print(f"  {'set':9} {'mix':6} {'kind':8} {'ratio':>7} {'min-max':>11} {'revision ms':>12} {'checkout ms':>12}")
        for name in a.sets.split(","):
            for mix in a.mixes.split(","):
                for kind in a.kinds.split(","):
                    row = compare(old, name, mix, kind, a.reps)
                    rows.append(row)
                    if COMM.rank == 0:
                        print(f"  {name:9} {mix:6} {kind:8} {row['ratio']:6.3f}x {row['ratio_min']:5.2f}-{row['ratio_max']:<5.2f} "
                              f"{row['revision_seconds'] * 1e3:12.3f} {row['checkout_seconds'] * 1e3:12.3f}", flush=True)
    if a.out is not None and COMM.rank == 0:
        meta = {"rev": a.rev, "world_size": COMM.size, "casts": a.casts, "reps": a.reps, "command": " ".join(sys.argv)}
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
