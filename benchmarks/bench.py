"""Time mpidp against the raw MPI limit and against its peers, in one run.

Run it under MPI (every rank runs the same command)::

    mpiexec -n 4 python -m mpi4py benchmarks/bench.py           # every set and variant, minutes
    mpiexec -n 4 python -m mpi4py benchmarks/bench.py --chunks  # the chunk_bytes sweep, minutes
    mpiexec -n 4 python -m mpi4py benchmarks/bench.py --quick   # a CI smoke run of both, seconds
    mpiexec -n 2 python -m mpi4py benchmarks/bench.py --sets gpt2 --no-torch

For every gradient set it first finds the *raw limit*: the fastest chunk
size (1 to 64 MiB) for an Allreduce of one preallocated float32 buffer that
holds all the set's parameters (and the same for Bcast, the limit of
``initialize``). Then every candidate is timed in pairs with that limit:
each repetition times the limit and the candidate back to back (in
alternating order), and the reported ratio is the median over repetitions
of ``candidate / limit``, so that load changes on a shared machine cancel.

The ``--chunks`` sweep times mpidp's reduce for every ``chunk_bytes`` from
1 to 64 MiB against the same limit: it is what ``DEFAULT_CHUNK_BYTES`` rests on.

Writes ``<out>/bench-np<N>.json`` (``chunks-np<N>.json`` with ``--chunks``,
``quick-np<N>.json`` with ``--quick``) and redraws ``<out>/bench.png``
(``quick.png``) from every such file in ``<out>``: per set, five ways of
summing float32 gradients against the raw Allreduce, one bar per rank count
(``report.chart``; the sweep is in the JSON and the printed table). Extra memory during reduce is measured too (peak
resident set and peak traced allocations above the state before the call).
Nothing here gates on time: the targets are reported, not asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import gradsets
import report

import mpidp
from mpidp import packing
from mpidp.casts import Casts
from mpidp.packing import DEFAULT_CHUNK_BYTES

COMM = MPI.COMM_WORLD
MIB = 1 << 20
#: chunk sizes the raw limit is the best of
LIMIT_CHUNKS_MIB = (1, 2, 4, 8, 16, 32, 64)
#: DDP's default bucket_cap_mb
DDP_BUCKET_BYTES = 25 * MIB

Fn = Callable[[], Any]


#: calls between two resets of the gradients (see :func:`timed`)
GROUP = 8


def local_weight() -> int:
    """Tokens behind this rank's gradients: 2 on rank 0, 1 elsewhere.

    The global weight ``N + 1`` is odd, as token counts usually are, so mpidp
    really divides (a power of two takes its exact, cheaper multiply).
    """
    return 1 + (COMM.rank == 0)


def global_weight() -> int:
    return COMM.size + 1


def reset_values(arrays: Sequence[Any]) -> Fn:
    """Return a function that refills gradients with normal numbers (1 + rank / 8, exact in every dtype).

    Every reduce divides the sum by ``N + 1``, so repeated calls shrink the
    gradients by ``N / (N + 1)``; refilling them every :data:`GROUP` calls
    (outside the timed region) keeps them far from subnormal numbers, whose
    arithmetic is many times slower and would measure the data, not the code.
    """
    value = 1.0 + COMM.rank / 8

    def reset() -> None:
        for a in arrays:
            a.fill(value)

    return reset


# ------------------------------------------------------------------ timing


def timed(fn: Fn, inner: int, reset: Fn | None = None) -> float:
    """Seconds per call of ``fn`` (``inner`` calls), the slowest rank's; collective.

    With ``reset``, the calls run in groups of :data:`GROUP`, each after an
    untimed ``reset()`` and a barrier; only the calls are timed.
    """
    if reset is None:
        COMM.Barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        dt = time.perf_counter() - t0
    else:
        dt, left = 0.0, inner
        while left > 0:
            reset()
            COMM.Barrier()
            t0 = time.perf_counter()
            for _ in range(min(GROUP, left)):
                fn()
            dt += time.perf_counter() - t0
            left -= GROUP
    return float(COMM.allreduce(dt / inner, op=MPI.MAX))


def paired(
    limit: Fn, candidate: Fn, reps: int, warmup: int, inner: int, reset: Fn | None = None, limit_reset: Fn | None = None
) -> dict[str, Any]:
    """Time ``limit`` and ``candidate`` back to back in every repetition; collective.

    With ``reset``, the candidate's calls each follow an untimed rewrite of its
    arrays; ``limit_reset`` rewrites the limit's buffer the same way, so that
    both start from the same cache state (freshly written, dirty memory).
    """
    for _ in range(warmup):
        if reset is not None:
            reset()
        candidate()
        limit()
    lim: list[float] = []
    cand: list[float] = []
    for r in range(reps):
        if r % 2 == 0:
            lim.append(timed(limit, inner, limit_reset))
            cand.append(timed(candidate, inner, reset))
        else:
            cand.append(timed(candidate, inner, reset))
            lim.append(timed(limit, inner, limit_reset))
    ratios = [c / x for c, x in zip(cand, lim)]
    return {
        "seconds": statistics.median(cand),
        "limit_seconds": statistics.median(lim),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "samples": {"seconds": cand, "limit_seconds": lim, "ratios": ratios},
    }


def inner_for(seconds: float, target: float) -> int:
    """Calls per timing so that one timing lasts about ``target`` seconds (equal on every rank)."""
    return max(1, min(1000, math.ceil(target / max(seconds, 1e-7))))


# ------------------------------------------------------------------ memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory(fn: Fn) -> dict[str, int | None]:
    """Extra memory of one call of ``fn``, the largest over ranks; collective.

    ``rss_extra_bytes``: the peak resident set during the call minus the
    resident set before it (Linux VmHWM after resetting it), ``traced_peak_bytes``:
    the peak of Python and NumPy allocations during the call (tracemalloc).
    """
    gc.collect()
    before = _rss()
    extra: int | None = None
    if _reset_hwm():
        fn()
        peak = _hwm()
        extra = None if peak is None else max(0, peak - before)
    tracemalloc.start()
    try:
        fn()
        traced = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    extras = COMM.allgather(extra)
    return {
        "rss_extra_bytes": None if None in extras else max(e for e in extras if e is not None),
        "traced_peak_bytes": int(COMM.allreduce(traced, op=MPI.MAX)),
    }


# ------------------------------------------------------------ the raw limit


def chunk_views(buf: np.ndarray, chunk_bytes: int) -> list[np.ndarray]:
    n = max(1, chunk_bytes // buf.itemsize)
    return [buf[s : s + n] for s in range(0, buf.size, n)]


def raw_allreduce(buf: np.ndarray, chunk_bytes: int) -> Fn:
    views = chunk_views(buf, chunk_bytes)

    def run() -> None:
        for v in views:
            COMM.Allreduce(MPI.IN_PLACE, v, MPI.SUM)

    return run


def raw_allreduce_divide(buf: np.ndarray, chunk_bytes: int) -> Fn:
    """The limit's chunked Allreduce, each chunk then divided by the global weight in place.

    The floor of any implementation of the mean that sums, then divides, as
    mpidp's semantics ask: the limit plus one pass over the bytes.
    """
    return allreduce_divide(chunk_views(buf, chunk_bytes))


def raw_scatter_gather(n: int, chunk_bytes: int, gather_itemsize: int = 4) -> Fn:
    """The second limit: per chunk, a float32 Reduce_scatter_block, then an in-place Allgather of the shares.

    ``n`` float32 values in chunks of ``chunk_bytes`` (each padded to a
    multiple of the world size); the Allgather moves ``gather_itemsize``-byte
    values (2: what mpidp gathers for 16-bit gradients). No division, no cast.
    """
    size = COMM.size
    per = max(1, chunk_bytes // 4)
    lengths = [-(-min(per, n - s) // size) * size for s in range(0, n, per)]
    send = np.full(max(lengths), 0, dtype=np.float32)
    shard = np.empty(max(lengths) // size, dtype=np.float32)
    gather = np.full(max(lengths) * gather_itemsize, 0, dtype=np.uint8)

    def run() -> None:
        for length in lengths:
            COMM.Reduce_scatter_block(send[:length], shard[: length // size], MPI.SUM)
            COMM.Allgather(MPI.IN_PLACE, gather[: length * gather_itemsize])

    return run


def raw_bcast(buf: np.ndarray, chunk_bytes: int) -> Fn:
    views = chunk_views(buf, chunk_bytes)

    def run() -> None:
        for v in views:
            COMM.Bcast(v, 0)

    return run


def sweep(make: Callable[[int], Fn], chunks_mib: Sequence[int], rounds: int, target: float) -> dict[str, Any]:
    """Time ``make(chunk)`` for every chunk size, alternating sizes within rounds; collective."""
    fns = {c: make(c * MIB) for c in chunks_mib}
    for fn in fns.values():  # warm-up: touch MPICH's buffers at every size
        fn()
    probe = min(timed(fn, 1) for fn in fns.values())
    inner = inner_for(probe, target)
    times: dict[int, list[float]] = {c: [] for c in chunks_mib}
    for r in range(rounds):
        order = list(chunks_mib) if r % 2 == 0 else list(reversed(chunks_mib))
        for c in order:
            times[c].append(timed(fns[c], inner))
    medians = {c: statistics.median(t) for c, t in times.items()}
    best = min(medians, key=lambda c: medians[c])
    return {
        "best_chunk_bytes": best * MIB,
        "seconds": medians[best],
        "inner": inner,
        "by_chunk_mib": {str(c): medians[c] for c in chunks_mib},
        "fn": fns[best],
    }


# ------------------------------------------------------------- candidates


def random_arrays(layout: list[tuple[str, tuple[int, ...]]], mix: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s, dtype=np.float32).astype(gradsets.dtype_of(mix, s)) for n, s in layout}


def empty_arrays(layout: list[tuple[str, tuple[int, ...]]], mix: str) -> dict[str, np.ndarray]:
    """Caller-allocated gradients, one array per tensor (values: see :func:`reset_values`)."""
    out = {n: np.empty(s, dtype=gradsets.dtype_of(mix, s)) for n, s in layout}
    reset_values(list(out.values()))()
    return out


def allreduce_divide(views: Sequence[np.ndarray]) -> Fn:
    """One in-place Allreduce per float32 view, each followed by the division by the global weight."""
    w = np.float32(global_weight())

    def run() -> None:
        for v in views:
            COMM.Allreduce(MPI.IN_PLACE, v, MPI.SUM)
            np.divide(v, w, out=v)

    return run


def per_tensor(grads: dict[str, np.ndarray]) -> Fn:
    """The reference design: one in-place Allreduce and one division per tensor (float32)."""
    return allreduce_divide(list(grads.values()))


#: Horovod's HOROVOD_FUSION_THRESHOLD as tuned on this machine (its 128 MiB default is slower here)
HOROVOD_FUSION_BYTES = 4 * MIB


#: Horovod's CacheCoordinator status bits, ahead of one bit per cached response (per tensor)
HOROVOD_STATUS_BITS = 3


def horovod_fusion(grads: dict[str, np.ndarray], threshold: int = HOROVOD_FUSION_BYTES, sync: bool = False) -> Fn:
    """Horovod's CPU data path over MPI, in NumPy: tensors in order are fused into responses of at most
    ``threshold`` bytes; a response of one tensor is reduced in place in one call (however large), a
    response of several is copied into the fusion buffer, reduced, scaled and copied out.

    With ``sync``, each step first runs what Horovod's background thread runs every cycle once every
    tensor is in its response cache (the steady state): ``CacheCoordinator::sync``, an in-place
    ``MPI_Allreduce`` with ``MPI_BAND`` of a bit vector of ``long long``, one bit per cached response
    plus status bits. All of a step's tensors are assumed ready in one cycle, and the cycle's sleep
    (``HOROVOD_CYCLE_TIME``) is left out: both favour Horovod.
    """
    tensors = [g.reshape(-1) for g in grads.values()]
    groups: list[list[np.ndarray]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > threshold:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    fusion = np.empty(threshold // 4, np.float32)
    w = np.float32(global_weight())
    bits = np.empty((len(tensors) + HOROVOD_STATUS_BITS + 63) // 64, np.int64)

    def run() -> None:
        if sync:
            bits.fill(-1)  # every response cached on every rank: all bits set
            COMM.Allreduce(MPI.IN_PLACE, bits, MPI.BAND)
        for group in groups:
            if len(group) == 1:
                g = group[0]
                COMM.Allreduce(MPI.IN_PLACE, g, MPI.SUM)
                np.divide(g, w, out=g)
                continue
            offset = 0
            for t in group:
                fusion[offset : offset + t.size] = t
                offset += t.size
            buf = fusion[:offset]
            COMM.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            np.divide(buf, w, out=buf)
            offset = 0
            for t in group:
                t[...] = fusion[offset : offset + t.size]
                offset += t.size

    return run


def mpidp_reduce(dp: mpidp.DataParallel, grads: dict[str, Any]) -> Fn:
    weight = local_weight()

    def run() -> None:
        dp.reduce(grads, weight)

    return run


class Gloo:
    """torch.distributed over gloo on 127.0.0.1, ranks and world from MPI."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)  # one core per rank, as for MPI
        port = 0
        if COMM.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = COMM.bcast(port, root=0)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=COMM.rank, world_size=COMM.size
        )

    def close(self) -> None:
        self.dist.destroy_process_group()

    def tensors(self, grads: dict[str, np.ndarray]) -> list[Any]:
        return [self.torch.from_numpy(g) for g in grads.values()]

    def flat(self, grads: dict[str, np.ndarray]) -> Fn:
        """Pack everything into one flat tensor, one all_reduce, divide, unpack."""
        torch, dist = self.torch, self.dist
        ts = [t.view(-1) for t in self.tensors(grads)]
        sizes = [t.numel() for t in ts]
        flat = torch.empty(sum(sizes), dtype=torch.float32)
        w = float(global_weight())

        def run() -> None:
            torch.cat(ts, out=flat)
            dist.all_reduce(flat)
            flat.div_(w)
            for t, v in zip(ts, torch.split(flat, sizes)):
                t.copy_(v)

        return run

    def buckets(self, grads: dict[str, np.ndarray], cap: int = DDP_BUCKET_BYTES) -> Fn:
        """DDP's way: 25 MiB buckets in reverse order, async all_reduce per bucket, then unpack."""
        torch, dist = self.torch, self.dist
        ts = [t.view(-1) for t in reversed(self.tensors(grads))]
        groups: list[list[Any]] = [[]]
        size = 0
        for t in ts:
            if groups[-1] and size + t.numel() * 4 > cap:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.numel() * 4
        flats = [torch.empty(sum(t.numel() for t in g), dtype=torch.float32) for g in groups]
        splits = [[t.numel() for t in g] for g in groups]
        w = float(global_weight())

        def run() -> None:
            works = []
            for g, f in zip(groups, flats):
                torch.cat(g, out=f)
                works.append(dist.all_reduce(f, async_op=True))
            for g, f, s, work in zip(groups, flats, splits, works):
                work.wait()
                f.div_(w)
                for t, v in zip(g, torch.split(f, s)):
                    t.copy_(v)

        return run


# ---------------------------------------------------------------- one set


def log(msg: str) -> None:
    if COMM.rank == 0:
        print(msg, file=sys.stderr, flush=True)


def bench_set(name: str, args: argparse.Namespace, gloo: Gloo | None) -> dict[str, Any]:
    """Time every candidate on one gradient set; collective."""
    description, layout = gradsets.shapes(name, args.quick)
    n = gradsets.count(layout)
    nbytes = 4 * n
    log(f"== {name}: {len(layout)} tensors, {n:,} parameters, {nbytes / MIB:.1f} MiB in fp32")
    rank, target = COMM.rank, args.target_seconds
    out: dict[str, Any] = {
        "description": description,
        "tensors": len(layout),
        "parameters": n,
        "fp32_bytes": nbytes,
        "limits": {},
        "variants": {},
    }
    reps, warmup = args.reps, args.warmup

    # written zeros: they stay zeros (no overflow, no denormals), and unlike np.zeros' untouched
    # pages (the kernel's one zero page, cache-hot for a root that only reads) they are real memory
    limit_buf = np.full(n, 0, dtype=np.float32)
    ar = sweep(lambda c: raw_allreduce(limit_buf, c), args.limit_chunks, args.rounds, target)
    bc_buf = np.full(nbytes, 1, dtype=np.uint8)  # written memory, as parameters are
    bc = sweep(lambda c: raw_bcast(bc_buf, c), args.limit_chunks, args.rounds, target)
    limit, bcast_limit = ar.pop("fn"), bc.pop("fn")

    def zero_limit() -> None:
        limit_buf.fill(0)

    out["limits"] = {"allreduce": ar, "bcast": bc}
    log(f"   raw Allreduce limit {ar['seconds'] * 1e3:.2f} ms at {ar['best_chunk_bytes'] // MIB} MiB chunks; "
        f"raw Bcast {bc['seconds'] * 1e3:.2f} ms at {bc['best_chunk_bytes'] // MIB} MiB")
    inner = ar["inner"]

    def record(key: str, label: str, against: str, res: dict[str, Any], **extra: Any) -> None:
        res = {"label": label, "limit": against, **res, **extra}
        out["variants"][key] = res
        log(f"   {label:<34} {res['seconds'] * 1e3:10.2f} ms  x{res['ratio']:.2f}  (limit {res['limit_seconds'] * 1e3:.2f} ms)")

    def want(key: str) -> bool:
        return args.variants is None or key in args.variants

    if want("raw_one_call"):
        record("raw_one_call", "raw Allreduce, one call", "allreduce",
               paired(limit, raw_allreduce(limit_buf, nbytes), reps, warmup, inner))

    if want("raw_scatter"):
        record("raw_scatter", "raw Reduce_scatter + Allgather", "allreduce",
               paired(limit, raw_scatter_gather(n, ar["best_chunk_bytes"]), reps, warmup, inner))
    if want("raw_scatter_half"):
        record("raw_scatter_half", "raw Reduce_scatter + 16-bit Allgather", "allreduce",
               paired(limit, raw_scatter_gather(n, ar["best_chunk_bytes"], 2), reps, warmup, inner))

    if want("raw_divide"):
        floor_buf = np.full(n, 0, dtype=np.float32)
        record("raw_divide", "raw Allreduce + division (floor)", "allreduce",
               paired(limit, raw_allreduce_divide(floor_buf, ar["best_chunk_bytes"]), reps, warmup, inner,
                      reset_values([floor_buf]), zero_limit))
        del floor_buf

    fp32 = random_arrays(layout, "fp32", 1000 + rank)
    if want("per_tensor"):
        record("per_tensor", "one Allreduce per tensor", "allreduce",
               paired(limit, per_tensor(fp32), reps, warmup, inner, reset_values(list(fp32.values())), zero_limit))

    if want("horovod_fusion"):
        record("horovod_fusion", f"Horovod-style fusion, {HOROVOD_FUSION_BYTES // MIB} MiB", "allreduce",
               paired(limit, horovod_fusion(fp32), reps, warmup, inner, reset_values(list(fp32.values())), zero_limit))
    if want("horovod_synced"):
        record("horovod_synced", f"Horovod-style fusion, {HOROVOD_FUSION_BYTES // MIB} MiB, + cache sync", "allreduce",
               paired(limit, horovod_fusion(fp32, sync=True), reps, warmup, inner, reset_values(list(fp32.values())),
                      zero_limit))

    # mpidp, for each dtype mix and reduction mode: caller-allocated arrays and gradient_buffers()
    for mix in gradsets.MIXES:
        suffixes = ["" if m == "auto" else f"_{m}" for m in args.reductions]
        wanted = [f"mpidp_{mix}_{kind}{x}" for kind in ("arrays", "buffers") for x in suffixes]
        if not any(map(want, wanted + (["mpidp_initialize", "mpidp_initialize_flat"] if mix == "fp32" else []))):
            continue
        params = fp32 if mix == "fp32" else random_arrays(layout, mix, 2000 + rank)
        params = {k: v.copy() for k, v in params.items()}
        for key in [k for k in ("mpidp_initialize", "mpidp_initialize_flat") if mix == "fp32" and want(k)]:
            # the caller's separate arrays, or the same values in mpidp.flat_parameters' storage
            laid_out = params if key == "mpidp_initialize" else mpidp.flat_parameters(params)

            def init(laid_out: dict[str, np.ndarray] = laid_out) -> None:
                mpidp.DataParallel.initialize(laid_out, COMM, chunk_bytes=args.chunk_bytes).close()

            probe = timed(init, 1)
            label = "mpidp initialize (+close)" if key == "mpidp_initialize" else "mpidp initialize, flat_parameters"
            record(key, label, "bcast", paired(bcast_limit, init, reps, warmup, max(1, min(bc["inner"], inner_for(probe, target)))))
            del laid_out, init
        for mode in args.reductions:
            suffix, how = ("", "") if mode == "auto" else (f"_{mode}", f", {mode}")
            keys = [k for k in (f"mpidp_{mix}_arrays{suffix}", f"mpidp_{mix}_buffers{suffix}") if want(k)]
            if keys:
                bench_reduce(params, layout, mix, suffix, how, mode, keys, limit, zero_limit, record, want, args, inner)
        del params
        gc.collect()

    if gloo is not None:
        if want("gloo_flat"):
            record("gloo_flat", "torch gloo, one flat buffer", "allreduce",
                   paired(limit, gloo.flat(fp32), reps, warmup, inner, reset_values(list(fp32.values())), zero_limit))
        if want("gloo_buckets"):
            record("gloo_buckets", "torch gloo, 25 MiB buckets (DDP)", "allreduce",
                   paired(limit, gloo.buckets(fp32), reps, warmup, inner, reset_values(list(fp32.values())), zero_limit))
    del fp32
    gc.collect()
    return out


def bench_reduce(
    params: dict[str, np.ndarray], layout: list[tuple[str, tuple[int, ...]]], mix: str, suffix: str, how: str, mode: str,
    keys: list[str], limit: Fn, zero_limit: Fn, record: Callable[..., None], want: Callable[[str], bool],
    args: argparse.Namespace, inner: int,
) -> None:
    """mpidp reduce of one mix under one ``MPIDP_REDUCTION`` mode: caller arrays, gradient_buffers, NumPy casts; collective."""
    reps, warmup = args.reps, args.warmup
    before = os.environ.get("MPIDP_REDUCTION")
    os.environ["MPIDP_REDUCTION"] = mode  # read by initialize, alike on every rank
    try:
        dp = mpidp.DataParallel.initialize(params, COMM, chunk_bytes=args.chunk_bytes)
    finally:
        if before is None:
            del os.environ["MPIDP_REDUCTION"]
        else:
            os.environ["MPIDP_REDUCTION"] = before
    try:
        for kind in ("arrays", "buffers"):
            key = f"mpidp_{mix}_{kind}{suffix}"
            if key not in keys:
                continue
            grads = empty_arrays(layout, mix) if kind == "arrays" else dp.gradient_buffers()
            fn = mpidp_reduce(dp, grads)
            reset = reset_values(list(grads.values()))
            label = f"mpidp reduce {mix}, {'separate arrays' if kind == 'arrays' else 'gradient_buffers'}{how}"
            record(key, label, "allreduce", paired(limit, fn, reps, warmup, inner, reset, zero_limit), memory=memory(fn))
            short = "arrays" if kind == "arrays" else "buffers"
            for other, settings in other_casts(mix):  # what a process without torch (or without numba) gets
                other_key = f"mpidp_{mix}_{kind}_{other}_casts{suffix}"
                if not want(other_key):
                    continue
                with cast_settings(dp, settings):
                    res = paired(limit, fn, reps, warmup, inner, reset, zero_limit)
                record(other_key, f"mpidp reduce {mix}, {short}, {CAST_NAMES[other]} casts{how}", "allreduce", res)
            del grads, fn, reset
    finally:
        dp.close()


def bench_chunks(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """mpidp reduce (gradient_buffers, fp32 and mixed) for every chunk_bytes, against the best raw limit."""
    _, layout = gradsets.shapes(name, args.quick)
    n = gradsets.count(layout)
    log(f"== chunks: {name}, mpidp reduce for chunk_bytes in {', '.join(map(str, args.limit_chunks))} MiB")
    limit_buf = np.full(n, 0, dtype=np.float32)  # written memory, as in bench_set
    ar = sweep(lambda c: raw_allreduce(limit_buf, c), args.limit_chunks, args.rounds, args.target_seconds)
    limit = ar.pop("fn")
    rows = []
    for mib in args.limit_chunks:
        row: dict[str, Any] = {"chunk_bytes": mib * MIB, "raw_ratio": ar["by_chunk_mib"][str(mib)] / ar["seconds"]}
        for mix in ("fp32", "mixed"):
            params = random_arrays(layout, mix, 5000 + COMM.rank)
            with mpidp.DataParallel.initialize(params, COMM, chunk_bytes=mib * MIB) as dp:
                bufs = dp.gradient_buffers()
                res = paired(limit, mpidp_reduce(dp, bufs), args.chunks_reps, args.warmup, ar["inner"],
                             reset_values(list(bufs.values())), lambda: limit_buf.fill(0))
                row[f"mpidp_{mix}_ratio"] = res["ratio"]
                row[f"mpidp_{mix}_seconds"] = res["seconds"]
                del bufs
            del params
            gc.collect()
        log(f"   {mib:3d} MiB  raw x{row['raw_ratio']:.2f}  mpidp fp32 x{row['mpidp_fp32_ratio']:.2f}  "
            f"mixed x{row['mpidp_mixed_ratio']:.2f}")
        rows.append(row)
    return {"set": name, "limit": ar, "rows": rows, "default_chunk_bytes": DEFAULT_CHUNK_BYTES}


# -------------------------------------------------------------------- main


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="scaled-down sets, few repetitions: a smoke run of seconds")
    p.add_argument("--sets", default=None, help="comma-separated gradient sets (default: all of the mode's sets)")
    p.add_argument("--variants", default=None, help="comma-separated variant keys to run (default: all)")
    p.add_argument("--reps", type=int, default=None, help="paired repetitions per candidate (default 7, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per candidate (default 1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the chunk-size sweep of the limit (default 5, quick 1)")
    p.add_argument("--target-seconds", type=float, default=None,
                   help="repeat calls inside one timing until it lasts this long (default 0.05, quick 0.005)")
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="mpidp's chunk_bytes")
    p.add_argument("--reductions", default="auto",
                   help="comma-separated MPIDP_REDUCTION modes to time mpidp's reduce under (default auto; "
                        "other modes' rows get the mode as a suffix)")
    p.add_argument("--chunks", action="store_true",
                   help="run only the chunk_bytes sweep (mpidp reduce for chunk_bytes 1-64 MiB) into chunks-np<N>.json; "
                        "--quick runs both")
    p.add_argument("--chunks-reps", type=int, default=None, help="paired repetitions per chunk size (default 3)")
    p.add_argument("--chunks-set", default=None, help="gradient set of the chunk_bytes sweep (default gpt2, quick gpt2-mini)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip torch.distributed even if installed")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="directory for JSON and PNG")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="write the JSON only")
    a = p.parse_args(argv)
    table = gradsets.QUICK_SETS if a.quick else gradsets.SETS
    a.sets = list(table) if a.sets is None else [s for s in a.sets.split(",") if s]
    for s in a.sets:
        gradsets.shapes(s, a.quick)
    a.variants = None if a.variants is None else set(a.variants.split(","))
    a.reductions = [m for m in a.reductions.split(",") if m]
    for m in a.reductions:
        if m not in packing.REDUCTIONS:
            p.error(f"--reductions: {m!r} is not one of {', '.join(packing.REDUCTIONS)}")
    a.reps = a.reps or (3 if a.quick else 7)
    a.chunks_reps = a.chunks_reps or 3
    a.rounds = a.rounds or (1 if a.quick else 5)
    a.target_seconds = a.target_seconds or (0.005 if a.quick else 0.05)
    a.limit_chunks = (1, 4) if a.quick else LIMIT_CHUNKS_MIB
    a.chunks_set = a.chunks_set or ("gpt2-mini" if a.quick else "gpt2")
    return a


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {"python": platform.python_version(), "numpy": np.__version__, "mpi4py": __import__("mpi4py").__version__}
    try:  # the installed version, without importing torch (that would switch mpidp to torch's casts)
        versions["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "system": f"{platform.system()} {platform.release()}",
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "versions": versions,
        "huge_pages": huge_pages(),
    }


def huge_pages() -> dict[str, str | None]:
    """Whether large NumPy arrays may get transparent huge pages: on a VM that moves timings up to 3x (local)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().strip()
    except OSError:
        mode = None
    return {"transparent_hugepage": mode, "NUMPY_MADVISE_HUGEPAGE": os.environ.get("NUMPY_MADVISE_HUGEPAGE")}


#: who casts 16-bit host values in mpidp (mpidp.casts): torch's kernels, mpidp.kernels (numba), NumPy / ml_dtypes
CAST_NAMES = {"torch": "torch", "numba": "numba", "numpy": "NumPy"}


def numba_casts() -> bool:
    """Whether mpidp.kernels (numba) can serve this process."""
    return Casts("numba").fastest() == "numba"


def casts() -> str:
    """Whose 16-bit casts a session mpidp makes in this process uses (``MPIDP_CASTS``, mpidp.casts.Casts)."""
    return Casts(os.environ.get("MPIDP_CASTS", "auto").strip().lower() or "auto").fastest()


def other_casts(mix: str) -> list[tuple[str, str]]:
    """The casts a process without torch (numba), and one without either (NumPy), would use, if not this one's: (name, mode)."""
    if mix == "fp32":
        return []
    out: list[tuple[str, str]] = []
    if casts() == "torch" and numba_casts():
        out.append(("numba", "numba"))
    if casts() != "numpy":
        out.append(("numpy", "numpy"))
    return out


@contextlib.contextmanager
def cast_settings(dp: mpidp.DataParallel, mode: str) -> Iterator[None]:
    """Give session ``dp`` the 16-bit casts of ``mode`` (an MPIDP_CASTS value) for the block (its private transport)."""
    before = dp._transport
    dp._transport = before._replace(casts=Casts(mode))
    try:
        yield
    finally:
        dp._transport = before


def torch_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_gloo_available())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    chunks_only = args.chunks and not args.quick
    started = time.time()
    load_start = os.getloadavg()
    use_torch = args.torch and not chunks_only and torch_available() and (args.variants is None or bool({"gloo_flat", "gloo_buckets"} & args.variants))
    use_torch = bool(COMM.allreduce(int(use_torch), op=MPI.MIN))
    gloo = Gloo() if use_torch else None
    result: dict[str, Any] = {
        "meta": {
            "command": " ".join([f"mpiexec -n {COMM.size} python -m mpi4py benchmarks/bench.py", *sys.argv[1:]]),
            "world_size": COMM.size,
            "quick": args.quick,
            "reps": args.reps,
            "warmup": args.warmup,
            "chunk_bytes": args.chunk_bytes,
            "reductions": args.reductions,
            "torch": gloo is not None,
            "casts": casts(),
            "numba": numba_casts(),
            "machine": machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "load_average_start": load_start,
        },
        "sets": {},
    }
    try:
        for name in [] if chunks_only else args.sets:
            result["sets"][name] = bench_set(name, args, gloo)
        if args.chunks or args.quick:
            result["chunks"] = bench_chunks(args.chunks_set, args)
    finally:
        if gloo is not None:
            gloo.close()
    result["meta"]["load_average_end"] = os.getloadavg()
    result["meta"]["casts_end"] = casts()  # must still be "casts": nothing on the way may switch them
    result["meta"]["seconds"] = time.time() - started
    result["targets"] = report.targets(result)
    if COMM.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prefix = "quick" if args.quick else "chunks" if chunks_only else "bench"
        path = out / f"{prefix}-np{COMM.size}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(report.table(result))
        print(f"\nwrote {path}")
        if args.plot:
            files = out.glob("quick-np*.json") if args.quick else [*out.glob("bench-np*.json"), *out.glob("chunks-np*.json")]
            png = report.chart(sorted(files), out / ("quick.png" if args.quick else "bench.png"))
            if png is not None:
                print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
