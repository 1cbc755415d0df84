"""Every collective of the "mpidp" backend against Gloo's on the same inputs, at 1-4 ranks; DDP; errors (run by test_backend.py).

Run as ``mpiexec -n 4 python -m mpi4py collectives_job.py``, with no torchrun
variable set: ``init_process_group("mpidp")`` takes them from MPI. Sub-groups
of the first 1, 2, 3 and 4 ranks are made twice, over "mpidp" and "gloo".
Every rank's inputs are a function of its rank, so every rank also knows
the exact answer (integer-valued data: the sums are exact in any order) and
checks both backends' results against it and against each other, bit for
bit. Where Gloo refuses a combination, "mpidp" must refuse it too, with the
same ContractError on every rank. Rank 0 prints one line per section and a
last line ``checks N failures F`` for every rank together.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp.torch.distributed  # noqa: F401 - registers "mpidp"

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DTYPES = (*FLOATS, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool)
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
failures: list[str] = []
counted = {"checks": 0, "gloo refuses": 0}


def check(name: str, ok: bool, detail: object = "") -> None:
    counted["checks"] += 1
    if not ok:
        failures.append(f"rank {RANK}: {name}: {detail}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes; for bool the same truth values (Gloo's bool SUM leaves 2 in a byte for True + True)."""
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a.shape == b.shape and bool(torch.equal(a.reshape(-1) != 0, b.reshape(-1).view(torch.uint8) != 0))
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, op: str = "SUM", salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: integer-valued, small enough that every op is exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * salt + len(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low, high = {"PRODUCT": (-1, 3), "MIN": (-50, 51), "MAX": (-50, 51), "BAND": (0, 100), "BOR": (0, 100), "BXOR": (0, 100)}.get(op, (-8, 9))
    if dtype == torch.uint8 or op == "PRODUCT" and dtype == torch.int8:
        low = max(low, 0)
    values = torch.randint(low, high, shape, generator=g)
    return values.to(dtype) if op != "PRODUCT" else torch.where(values == 0, torch.ones_like(values), values).to(dtype)


def outcome(fn: Callable[[], Any]) -> str:
    """"ok", or the exception's type and message."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared below
        return f"{type(e).__name__}: {e}"
    return "ok"


def both(name: str, mg: Any, gg: Any, run: Callable[[Any], list[torch.Tensor]], expected: list[torch.Tensor] | None = None) -> None:
    """Run ``run(group)`` on "mpidp" and on "gloo"; their outputs must be the same bits (and ``expected``'s)."""
    got: dict[str, list[torch.Tensor]] = {}
    ours = outcome(lambda: got.__setitem__("mpidp", run(mg)))
    theirs = outcome(lambda: got.__setitem__("gloo", run(gg)))
    if theirs != "ok":
        counted["gloo refuses"] += 1
        check(f"{name}: Gloo refuses ({theirs[:80]}), so must mpidp", ours.startswith("ContractError"), ours)
        return
    check(f"{name}: mpidp runs", ours == "ok", ours)
    if ours != "ok":
        return
    a, b = got["mpidp"], got["gloo"]
    check(f"{name}: mpidp's bits are Gloo's", len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b)), (a, b))
    if expected is not None:
        check(f"{name}: the exact answer", all(same_bits(x, y) for x, y in zip(a, expected)), (a, expected))


def exact(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The reduction of ``inputs`` in float64 (exact for the data above), in their dtype."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        return (stack.all(0) if op in ("MIN", "PRODUCT", "BAND") else stack.sum(0) % 2 == 1 if op == "BXOR" else stack.any(0))
    stack = torch.stack([t.double() for t in inputs])
    if op in ("BAND", "BOR", "BXOR"):
        longs = torch.stack([t.long() for t in inputs])
        fold = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = longs[0]
        for t in longs[1:]:
            out = fold(out, t)
        return out.to(dtype)
    value = {"SUM": stack.sum(0), "AVG": stack.mean(0), "PRODUCT": stack.prod(0), "MIN": stack.amin(0), "MAX": stack.amax(0)}[op]
    return value.to(dtype)


def allreduces(n: int, mg: Any, gg: Any) -> None:
    for dtype in DTYPES:
        for op in OPS:
            for shape in ((0,), (3, 5)):
                inputs = [data(r, shape, dtype, op) for r in range(n)]

                def run(group: Any, op: str = op, shape: tuple[int, ...] = shape, dtype: torch.dtype = dtype) -> list[torch.Tensor]:
                    t = data(RANK, shape, dtype, op)
                    t = t.t().contiguous().t() if len(shape) == 2 else t  # a non-contiguous tensor
                    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
                    return [t]

                both(f"all_reduce {op} {dtype} {shape} at {n}", mg, gg, run, [exact(op, inputs)])
    noisy = torch.randn(1000, generator=torch.Generator().manual_seed(RANK))  # not integer-valued: the order of the sum shows
    sums = {}
    for group, name in ((mg, "mpidp"), (gg, "gloo")):
        sums[name] = noisy.clone()
        dist.all_reduce(sums[name], group=group)
    same = same_bits(sums["mpidp"], sums["gloo"])
    close = torch.allclose(sums["mpidp"], sums["gloo"], rtol=1e-6, atol=1e-6)
    check(f"all_reduce SUM of random float32 at {n}: Gloo's bits at 2 ranks, close beyond", same if n <= 2 else close, n)


def moves(n: int, mg: Any, gg: Any) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        for count in (0, 5):
            ins = [data(r, (count,), dtype, salt=3) for r in range(n)]
            for root in range(n):
                both(f"broadcast {dtype} {count} from {root} at {n}", mg, gg,
                     lambda g, root=root, count=count, dtype=dtype: _broadcast(g, root, data(RANK, (count,), dtype, salt=3)), [ins[root]])
            both(f"all_gather {dtype} {count} at {n}", mg, gg, lambda g, count=count, dtype=dtype: _all_gather(g, n, data(RANK, (count,), dtype, salt=3)), ins)
            both(f"all_gather_into_tensor {dtype} {count} at {n}", mg, gg,
                 lambda g, count=count, dtype=dtype: _gather_into(g, n, data(RANK, (count,), dtype, salt=3)), [torch.cat(ins)])
            rows = [data(r, (n * count,), dtype, salt=4) for r in range(n)]
            for op in ("SUM", "MAX"):
                mine = exact(op, rows).chunk(n)[RANK] if n * count else torch.empty(0, dtype=dtype)
                both(f"reduce_scatter_tensor {op} {dtype} {count} at {n}", mg, gg,
                     lambda g, op=op, count=count, dtype=dtype: _reduce_scatter(g, n, op, data(RANK, (n * count,), dtype, salt=4)), [mine])
            splits = [(RANK + j) % 3 for j in range(n)]  # uneven, zeros among them
            both(f"all_to_all_single uneven {dtype} at {n}", mg, gg, lambda g, splits=splits, dtype=dtype: _all_to_all(g, n, splits, dtype))
            both(f"gather/scatter {dtype} {count} at {n}", mg, gg, lambda g, count=count, dtype=dtype: _gather_scatter(g, n, count, dtype))
            both(f"reduce SUM {dtype} {count} at {n}", mg, gg, lambda g, count=count, dtype=dtype: _reduce(g, count, dtype))
        if n > 1:  # Gloo refuses a send to oneself; MPI allows it
            both(f"send/recv ring {dtype} at {n}", mg, gg, lambda g, dtype=dtype: _ring(g, n, dtype))
    both(f"coalesced all_reduce at {n}", mg, gg, _coalesced)
    both(f"barrier at {n}", mg, gg, lambda g: [torch.tensor(0.0) if dist.barrier(group=g) is None else torch.tensor(1.0)])
    uneven = [torch.empty(r + 1) for r in range(n)]  # Gloo refuses uneven all_gather; mpidp moves it
    dist.all_gather(uneven, torch.full((RANK + 1,), float(RANK)), group=mg)
    check(f"uneven all_gather at {n}", all(same_bits(t, torch.full((r + 1,), float(r))) for r, t in enumerate(uneven)), uneven)


def _broadcast(g: Any, root: int, t: torch.Tensor) -> list[torch.Tensor]:
    dist.broadcast(t, group_src=root, group=g)
    return [t]


def _all_gather(g: Any, n: int, t: torch.Tensor) -> list[torch.Tensor]:
    outs = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(outs, t, group=g)
    return outs


def _gather_into(g: Any, n: int, t: torch.Tensor) -> list[torch.Tensor]:
    out = torch.empty(n * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t, group=g)
    return [out]


def _reduce_scatter(g: Any, n: int, op: str, t: torch.Tensor) -> list[torch.Tensor]:
    out = torch.empty(t.numel() // n, dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, op=getattr(dist.ReduceOp, op), group=g)
    return [out]


def _all_to_all(g: Any, n: int, splits: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    recv = [(r + RANK) % 3 for r in range(n)]  # rank r sends (r + me) % 3 rows to me
    out = torch.empty(sum(recv), 2, dtype=dtype)
    dist.all_to_all_single(out, data(RANK, (sum(splits), 2), dtype, salt=5), recv, splits, group=g)
    lists = [torch.empty(2, dtype=dtype) for _ in range(n)]
    dist.all_to_all(lists, list(data(RANK, (n, 2), dtype, salt=6).unbind(0)), group=g)
    return [out, *lists]


def _gather_scatter(g: Any, n: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    root = n - 1
    mine = data(RANK, (count,), dtype, salt=7)
    outs = [torch.empty_like(mine) for _ in range(n)] if RANK == root else None
    dist.gather(mine, outs, group_dst=root, group=g)
    got = torch.empty_like(mine)
    dist.scatter(got, [data(r, (count,), dtype, salt=8) for r in range(n)] if RANK == root else None, group_src=root, group=g)
    return [*(outs or []), got]


def _reduce(g: Any, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    t = data(RANK, (count,), dtype, salt=9)
    dist.reduce(t, group_dst=0, group=g)
    return [t] if dist.get_rank(g) == 0 else []


def _ring(g: Any, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    me = dist.get_rank(g)
    got = torch.empty(4, dtype=dtype)
    ops = [dist.P2POp(dist.isend, data(RANK, (4,), dtype, salt=10), group=g, group_peer=(me + 1) % n),
           dist.P2POp(dist.irecv, got, group=g, group_peer=(me - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [got]


def _coalesced(g: Any) -> list[torch.Tensor]:
    a, b = data(RANK, (6,), torch.float32, salt=11), data(RANK, (3,), torch.float32, salt=12)
    with dist._coalescing_manager(group=g):
        dist.all_reduce(a, group=g)
        dist.all_reduce(b, group=g)
    return [a, b]


def ddp(mg: Any, gg: Any) -> None:
    """Four AdamW steps of a small transformer under DDP, over each backend: the same parameters, bit for bit, on both ranks."""
    hashes = {}
    for name, group in (("mpidp", mg), ("gloo", gg)):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(32, 50))
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(RANK)
        for _ in range(4):
            tokens = torch.randint(0, 50, (4, 9), generator=g)
            loss = torch.nn.functional.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        digest = hashlib.sha256()
        for p in model.state_dict().values():
            digest.update(p.contiguous().view(torch.uint8).numpy().tobytes())
        hashes[name] = digest.hexdigest()
    every: list[Any] = [None, None]
    dist.all_gather_object(every, hashes, group=gg)
    check("DDP over mpidp: Gloo's parameters, bit for bit", hashes["mpidp"] == hashes["gloo"], hashes)
    check("DDP over mpidp: the same parameters on both ranks", every[0]["mpidp"] == every[1]["mpidp"], every)


def sharded(mg: Any, gg: Any) -> None:
    """FSDP2 (``fully_shard``) with ZeroRedundancyOptimizer beside it, and a torch.distributed.checkpoint round trip, over each backend."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    found = {}
    for name, group in (("mpidp", mg), ("gloo", gg)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        other = torch.nn.Linear(4, 4)
        zero = ZeroRedundancyOptimizer(other.parameters(), optimizer_class=torch.optim.SGD, process_group=group, lr=0.1)
        g = torch.Generator().manual_seed(RANK)
        for _ in range(3):
            model(torch.randn(5, 8, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
            other(torch.randn(2, 4, generator=g)).sum().backward()
            zero.step()
        full = [v.full_tensor() for v in model.state_dict().values()] + [p.detach().clone() for p in other.parameters()]
        folder = [tempfile.mkdtemp(prefix="mpidp-dcp-") if RANK == 0 else None]
        dist.broadcast_object_list(folder, group_src=0, group=group)
        state = {"model": model.state_dict()}
        save(state, checkpoint_id=folder[0], process_group=group)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load(state, checkpoint_id=folder[0], process_group=group)
        back = [v.full_tensor() for v in model.state_dict().values()]
        dist.barrier(group=group)
        if RANK == 0:
            shutil.rmtree(folder[0])
        check(f"torch.distributed.checkpoint over {name}: saved and loaded", all(same_bits(a, b) for a, b in zip(full, back)))
        found[name] = full
    check("FSDP2 and ZeroRedundancyOptimizer over mpidp: Gloo's bits", all(same_bits(a, b) for a, b in zip(found["mpidp"], found["gloo"])))


def errors(mg: Any) -> None:
    """Bad input on any rank: the same ContractError on every rank, and the group works on afterwards."""
    last = WORLD.Get_size() - 1
    cases = {
        "one rank passes another shape": lambda: dist.all_reduce(torch.ones(5 if RANK == last else 4), group=mg),
        "one rank calls another collective": lambda: dist.broadcast(torch.ones(4), 0, group=mg) if RANK == 1 % (last + 1) else dist.all_reduce(torch.ones(4), group=mg),
        "one rank passes another dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64 if RANK == 0 else torch.float32), group=mg),
        "one rank's splits do not fit": lambda: dist.all_to_all_single(torch.empty(last + 1), torch.ones(last + 1), input_split_sizes=[last + 2] + [0] * last if RANK == last else None, group=mg),
        "one rank gathers a longer tensor": lambda: dist.all_gather([torch.empty(4) for _ in range(last + 1)], torch.ones(5 if RANK == last else 4), group=mg),
        "AVG of integers": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG, group=mg),
    }
    for name, fn in cases.items():
        mine = outcome(fn)
        every = WORLD.allgather(mine)
        check(f"error: {name}: a ContractError", mine.startswith("ContractError: mpidp backend"), mine)
        check(f"error: {name}: the same on every rank", all(e == every[0] for e in every), every)
    t = torch.ones(3)
    dist.all_reduce(t, group=mg)
    check("the group works after the errors", same_bits(t, torch.full((3,), float(WORLD.Get_size()))), t)


def subgroups() -> None:
    """Groups of ranks in any order: the odd ranks, and new_subgroups' pairs; each all-reduces its own ranks only."""
    size = WORLD.Get_size()
    odd = [r for r in range(size) if r % 2]
    group = dist.new_group(odd)
    if RANK in odd:
        t = torch.tensor([float(RANK)])
        dist.all_reduce(t, group=group)
        check("a group of the odd ranks sums theirs", t.item() == sum(odd) and dist.get_rank(group) == odd.index(RANK), (t, odd))
    pair, _ = dist.new_subgroups(2)
    t = torch.tensor([float(RANK)])
    dist.all_reduce(t, group=pair)
    mine = [r for r in range(size) if r // 2 == RANK // 2]
    check("new_subgroups: each pair sums its own", t.item() == sum(mine) and dist.get_backend(pair) == "mpidp", (t, mine))


def quiet_barrier() -> None:
    """Wait for every rank, sleeping between polls (local MPI progress only)."""
    request = WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


_clock = [time.monotonic()]


def timed(name: str, run: Callable[[], object]) -> None:
    """Run one section; rank 0 prints its checks and the seconds since the last section ended."""
    before = counted["checks"]
    run()
    now = time.monotonic()
    if RANK == 0:
        print(f"rank {RANK}: {name}: {counted['checks'] - before} checks, {now - _clock[0]:.1f} s", flush=True)
    _clock[0] = now


def main() -> None:
    dist.init_process_group("mpidp", timeout=timedelta(seconds=90))
    check("rank and world size from MPI", (dist.get_rank(), dist.get_world_size()) == (RANK, WORLD.Get_size()))
    check("the default group is mpidp's", dist.get_backend() == "mpidp" and type(dist.group.WORLD).__name__ == "ProcessGroupMPIDP")
    groups = {n: (dist.new_group(list(range(n))), dist.new_group(list(range(n)), backend="gloo")) for n in range(1, WORLD.Get_size() + 1)}
    timed("set-up", lambda: None)
    for n, (mg, gg) in groups.items():
        if RANK < n:
            timed(f"all_reduce at {n}", lambda n=n, mg=mg, gg=gg: allreduces(n, mg, gg))
            timed(f"moves at {n}", lambda n=n, mg=mg, gg=gg: moves(n, mg, gg))
        quiet_barrier()  # the ranks outside wait asleep: MPI's busy wait would take the cores the others run on
    if RANK < 2:
        timed("DDP, FSDP2, ZeRO, DCP at 2", lambda: (ddp(*groups[2]), sharded(*groups[2])))
    quiet_barrier()
    subgroups()
    errors(dist.group.WORLD)
    carried = dist.group.WORLD.sequence
    check("the default group carried the traffic", carried > 0, carried)
    every = WORLD.gather((counted["checks"], counted["gloo refuses"], failures), root=0)
    dist.destroy_process_group()
    if RANK == 0:
        found = [f for _, _, fs in every for f in fs]
        print("\n".join(found[:40]))
        print(f"checks {sum(c for c, _, _ in every)} gloo-refuses {sum(g for _, g, _ in every)} failures {len(found)}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
