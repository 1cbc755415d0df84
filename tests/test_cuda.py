"""CUDA-awareness detection and device selection; GPU paths skip without a GPU."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidp
from mpidp import cuda


@pytest.mark.parametrize(
    ("override", "kinds", "query", "aware", "reason"),
    [
        ("1", "mpi,system", 0, True, "MPIDP_CUDA_AWARE=1"),
        ("0", "mpi,system,cuda", 1, False, "MPIDP_CUDA_AWARE=0"),
        (None, "mpi,system,cuda:device,cuda:host", None, True, "mpi_memory_alloc_kinds=mpi,system,cuda:device,cuda:host"),
        (None, "mpi,system,cuda", 0, True, "mpi_memory_alloc_kinds=mpi,system,cuda"),
        (None, "mpi,system", 1, True, "MPIX_Query_cuda_support() = 1"),
        (None, "mpi,system", 0, False, "MPIX_Query_cuda_support() = 0"),
        (None, "mpi,system", None, False, "mpi_memory_alloc_kinds=mpi,system"),
        (None, None, None, False, "the MPI library reports no CUDA support"),
        ("", None, 1, True, "MPIX_Query_cuda_support() = 1"),
        (None, "mpi,system,rocm", None, False, "mpi_memory_alloc_kinds=mpi,system,rocm"),
        (None, "mpi,system,cuda:host", None, False, "mpi_memory_alloc_kinds=mpi,system,cuda:host"),
        (None, "mpi,system,cuda:host,cuda:managed", 0, False, "MPIX_Query_cuda_support() = 0"),
        (None, "mpi,system,cuda:managed", 1, True, "MPIX_Query_cuda_support() = 1"),
    ],
)
def test_decide(override: str | None, kinds: str | None, query: int | None, aware: bool, reason: str) -> None:
    assert cuda.decide(override, kinds, query) == (aware, reason)


def test_decide_refuses_a_bad_override() -> None:
    with pytest.raises(ValueError, match="MPIDP_CUDA_AWARE must be 0 or 1, got 'maybe'"):
        cuda.decide("maybe", None, None)


def test_detect_on_this_mpi(comm: MPI.Comm) -> None:
    assert cuda.detect(comm, env={"MPIDP_CUDA_AWARE": "1"}) == (True, "MPIDP_CUDA_AWARE=1")
    aware, reason = cuda.detect(comm, env={})
    if "MPICH" in MPI.Get_library_version() and "cuda" not in reason:
        assert aware is False  # the MPICH wheel is not CUDA-aware


def test_local_rank(comm: MPI.Comm) -> None:
    ranks = comm.allgather((MPI.Get_processor_name(), cuda.local_rank(comm)))
    for host in {h for h, _ in ranks}:
        assert sorted(r for h, r in ranks if h == host) == list(range(sum(1 for h, _ in ranks if h == host)))


def _cuda_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_select_device_on_a_rank_that_cannot_is_one_error_everywhere(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rank fails to select a GPU: every rank raises the same ContractError, none goes on alone."""
    from conftest import same_error_everywhere

    last = comm.size - 1

    def select(device: int | None, rank: int = 0) -> int:
        if comm.rank == last:
            raise RuntimeError("select_device needs CuPy or a CUDA build of PyTorch, and a GPU")
        return rank

    monkeypatch.setattr(cuda, "_select", select)
    same_error_everywhere(
        comm, lambda: cuda.select_device(comm), mpidp.ContractError,
        f"rank {last}: select_device needs CuPy or a CUDA build of PyTorch, and a GPU",
    )


def test_select_device_names_a_cuda_error_of_one_rank(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import same_error_everywhere

    def select(device: int | None, rank: int = 0) -> int:
        if comm.rank == 0:
            raise OSError("CUDA driver version is insufficient")
        return rank

    monkeypatch.setattr(cuda, "_select", select)
    same_error_everywhere(comm, lambda: cuda.select_device(comm), mpidp.ContractError, "rank 0: OSError: CUDA driver version is insufficient")


@pytest.mark.skipif(_cuda_torch(), reason="a CUDA build of PyTorch can select a GPU here")
def test_select_device_without_any_gpu_is_one_error_everywhere(comm: MPI.Comm) -> None:
    from conftest import same_error_everywhere

    if cupy is not None:
        pytest.skip("CuPy sees a GPU (or the CPU stand-in) here")
    message = same_error_everywhere(comm, lambda: cuda.select_device(comm), mpidp.ContractError, "rank 0")
    assert "select_device needs CuPy or a CUDA build of PyTorch, and a GPU" in message or "CUDA" in message, message
    with pytest.raises(RuntimeError, match="select_device needs CuPy"):  # a device given: local, as before
        cuda.select_device(comm, device=0)


cupy = None
try:  # a GPU is needed for anything below
    import cupy  # type: ignore[no-redef]

    if cupy.cuda.runtime.getDeviceCount() < 1:
        cupy = None
except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: skip
    cupy = None


def needs_gpu(test: Any) -> Any:
    """A test on device arrays (``gpu``: the fake-GPU passes), skipped without CuPy and a GPU (or the CPU stand-in)."""
    return pytest.mark.gpu(pytest.mark.skipif(cupy is None, reason="needs CuPy and a GPU")(test))


#: the CPU stand-in for CuPy (tests/fakegpu) is loaded instead of CuPy
_FAKE = bool(getattr(cupy, "_mpidp_fake", False))


@pytest.fixture(params=["0", "1"])
def aware(request: pytest.FixtureRequest, comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> str:
    """``MPIDP_CUDA_AWARE`` for the test: "0" stages through host memory, "1" hands MPI device buffers.

    "1" needs a CUDA-aware MPI, or the stand-in, whose device memory any MPI reads.
    """
    if request.param == "1" and not cuda.detect(comm)[0] and not _FAKE:
        pytest.skip("this MPI is not CUDA-aware")
    monkeypatch.setenv("MPIDP_CUDA_AWARE", request.param)
    return str(request.param)


@needs_gpu
def test_cupy_reduce_matches_numpy(comm: MPI.Comm, aware: str) -> None:
    device = cuda.select_device(comm)
    rng = np.random.default_rng(comm.rank)
    host = {
        "w": rng.standard_normal((300, 70)).astype(np.float32),
        "b": rng.standard_normal(9).astype(np.float16),
    }
    params = {k: cupy.asarray(v) for k, v in host.items()}
    with mpidp.DataParallel.initialize(params, comm) as dp:
        assert dp.device == f"cuda:{device}"
        expected0 = comm.bcast(host, root=0)
        for k in host:
            assert np.array_equal(cupy.asnumpy(params[k]), expected0[k])
        grads = {k: cupy.asarray(rng.standard_normal(v.shape).astype(v.dtype)) for k, v in host.items()}
        every = comm.allgather({k: cupy.asnumpy(g).astype(np.float64) for k, g in grads.items()})
        out = dp.reduce(grads, comm.rank + 1)
        total = sum(range(1, comm.size + 1))
        for k, g in out.gradients.items():
            assert isinstance(g, cupy.ndarray) and g.dtype == params[k].dtype
            exact = sum(e[k] for e in every) / total
            tol = {"float32": 1e-6, "float16": 1e-3}[g.dtype.name]
            assert np.abs(cupy.asnumpy(g).astype(np.float64) - exact).max() <= tol * max(1, np.abs(exact).max())
        mine = {k: cupy.asnumpy(g).tobytes() for k, g in out.gradients.items()}
        assert all(o == mine for o in comm.allgather(mine))


@needs_gpu
def test_cupy_array_on_another_device_is_refused(comm: MPI.Comm) -> None:
    from conftest import same_error_everywhere

    cuda.select_device(comm)
    params = {"w": cupy.zeros(3, dtype=cupy.float32)}
    same_error_everywhere(
        comm, lambda: mpidp.DataParallel.initialize(params, comm, device="cuda:99"), mpidp.ContractError, "is on cuda:"
    )


@needs_gpu
def test_cupy_gradients_that_share_memory_are_refused(comm: MPI.Comm) -> None:
    from conftest import same_error_everywhere

    cuda.select_device(comm)
    params = {"a": cupy.zeros(8, dtype=cupy.float32), "b": cupy.zeros(4, dtype=cupy.float32)}
    with mpidp.DataParallel.initialize(params, comm) as dp:
        big = cupy.ones(8, dtype=cupy.float32)
        grads = {"a": big, "b": big[2:6] if comm.rank == comm.size - 1 else cupy.ones(4, dtype=cupy.float32)}
        same_error_everywhere(
            comm, lambda: dp.reduce(grads, 1), mpidp.ContractError, f"rank {comm.size - 1}: gradients 'a' and 'b' share memory"
        )
        assert float(big.sum()) == 8.0


@needs_gpu
def test_explicit_device_that_is_not_current_is_refused(comm: MPI.Comm) -> None:
    from conftest import same_error_everywhere

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        params = {"w": cupy.zeros(3, dtype=cupy.float32)}
    cupy.cuda.Device(0).use()
    same_error_everywhere(
        comm,
        lambda: mpidp.DataParallel.initialize(params, comm, device="cuda:1"),
        mpidp.ContractError,
        "device cuda:1 is not the current CUDA device (cuda:0)",
    )


@needs_gpu
def test_cupy_flat_parameters_share_one_device_buffer_and_broadcast(comm: MPI.Comm) -> None:
    device = cuda.select_device(comm)
    rng = np.random.default_rng(comm.rank)
    host = {"w": rng.standard_normal((30, 7)).astype(np.float32), "v": rng.standard_normal(5).astype(np.float32)}
    params = mpidp.flat_parameters({k: cupy.asarray(v) for k, v in host.items()})
    assert params["w"].data.ptr + params["w"].nbytes == params["v"].data.ptr or params["v"].data.ptr + params["v"].nbytes == params["w"].data.ptr
    assert all(p.device.id == device for p in params.values())
    with mpidp.DataParallel.initialize(params, comm):
        expected = comm.bcast(host, root=0)
        for k in host:
            assert np.array_equal(cupy.asnumpy(params[k]), expected[k])


class _Recording:
    """Stands in for the session's MPI communicator and records what each Allreduce was given."""

    def __init__(self, comm: MPI.Comm, seen: list[tuple[str, int]], copies: Any = None) -> None:
        self._comm, self._seen, self._copies = comm, seen, copies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def Allreduce(self, send: Any, recv: Any, op: Any) -> None:
        # what MPI was given, and (fake CuPy only: its copies run when waited for) whether a copy
        # on the staging stream was still queued, i.e. overlapped with this call
        pending = self._copies is not None and not self._copies.done
        self._seen.append((type(recv).__module__.split(".")[0] + ("+pending" if pending else ""), recv.size))
        self._comm.Allreduce(send, recv, op)


def _mixed_set(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "big": rng.standard_normal(3000).astype(np.float32),  # 12 KB: direct calls of their own at 4 KiB chunks
        "w": rng.standard_normal((40, 30)).astype(np.float32),
        "h": rng.standard_normal(700).astype(np.float16),
        "b": rng.standard_normal(9).astype(np.float32),
        "t": rng.standard_normal((20, 30)).astype(np.float32),  # its gradient is a transposed (strided) view
        "gone": rng.standard_normal(50).astype(np.float32),  # no gradient on rank 1
    } | ({} if mpidp.arrays.device_bfloat16_problem() else {"z": rng.standard_normal(1500).astype(mpidp.arrays.BFLOAT16)})


@needs_gpu
def test_cupy_reduce_is_bitwise_the_host_result(comm: MPI.Comm, aware: str) -> None:
    """Many calls per window (4 KiB chunks): direct and packed, 16-bit, a strided gradient, a missing one, weight 0."""
    cuda.select_device(comm)
    rng = np.random.default_rng(7)
    host = _mixed_set(rng)
    grads_rng = np.random.default_rng(100 + comm.rank)
    host_grads = {k: grads_rng.standard_normal(v.shape).astype(v.dtype) for k, v in host.items()}
    host_grads["t"] = np.ascontiguousarray(host_grads["t"].T).T  # same values, Fortran order
    if comm.rank == 1:
        del host_grads["gone"]
    weight = comm.rank  # rank 0 has weight 0: its gradients count as zeros
    policy = mpidp.MissingGradientPolicy.ZERO

    with mpidp.DataParallel.initialize({k: v.copy() for k, v in host.items()}, comm, chunk_bytes=4096) as ref:
        expected = {k: np.array(v) for k, v in ref.reduce({k: g.copy(order="K") for k, g in host_grads.items()}, weight, policy).gradients.items()}

    params = {k: cupy.asarray(v) for k, v in host.items()}
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=4096) as dp:
        assert dp.cuda_aware[0] is (aware == "1")
        seen: list[tuple[str, int]] = []
        staging = dp._transport.gpu.staging
        dp._comm.comm = _Recording(dp._comm.comm, seen, staging.stream if staging is not None and _FAKE else None)
        grads = {}
        for k, g in host_grads.items():
            grads[k] = cupy.asarray(np.ascontiguousarray(g))
        grads["t"] = cupy.asarray(np.ascontiguousarray(host_grads["t"].T)).T  # strided on the device too
        assert not grads["t"].flags.c_contiguous
        out = dp.reduce(grads, weight, policy).gradients
        if _FAKE:  # nothing is left queued: the results are ready for any stream and for the host
            assert cupy.cuda.get_current_stream().done and (staging is None or staging.stream.done)
        assert sorted(out) == sorted(expected)
        # the same MPI sums the same host buffers when staged: bitwise; a CUDA-aware MPI may add the
        # ranks' values in another order on the device (the stand-in's is the host MPI)
        bitwise = aware == "0" or _FAKE
        for k, g in out.items():
            assert isinstance(g, cupy.ndarray) and g.dtype == expected[k].dtype
            if bitwise:
                assert cupy.asnumpy(g).tobytes() == np.ascontiguousarray(expected[k]).tobytes(), k
            else:
                tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}[str(g.dtype)]
                got, want = cupy.asnumpy(g).astype(np.float64), expected[k].astype(np.float64)
                assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), k
        mine = {k: cupy.asnumpy(g).tobytes() for k, g in out.items()}
        assert all(o == mine for o in comm.allgather(mine))  # bitwise equal on every rank, always
        assert cupy.asnumpy(grads["t"]).tobytes() == mine["t"]  # written back into the strided gradient
        assert len(seen) > 3, seen
        if aware == "0":
            # a device pointer never reaches an MPI that is not CUDA-aware
            assert all(kind.startswith("numpy") for kind, _ in seen), seen
            if _FAKE and os.environ.get("MPIDP_FAKE_SCHEDULE", "lazy") == "lazy":
                # the next call's copy down is queued behind each Allreduce (the stand-in's default schedule
                # runs queued work only when waited for; the random one may have run it already)
                assert all(kind == "numpy+pending" for kind, _ in seen[:-1]), seen
        else:
            assert all(kind.startswith("cupy") for kind, _ in seen), seen


@needs_gpu
def test_cupy_initialize_broadcasts_in_many_calls(comm: MPI.Comm, aware: str) -> None:
    cuda.select_device(comm)
    host = _mixed_set(np.random.default_rng(comm.rank))
    params = {k: cupy.asarray(v) for k, v in host.items()}
    params["t"] = cupy.asarray(np.ascontiguousarray(host["t"].T)).T
    with mpidp.DataParallel.initialize(params, comm, chunk_bytes=4096) as dp:
        root = comm.bcast(host, root=0)
        for k in host:
            assert cupy.asnumpy(params[k]).tobytes() == np.ascontiguousarray(root[k]).tobytes(), k
        dp.verify_replicas()


@needs_gpu
def test_bfloat16_gpu_arrays_without_device_casts_are_refused_on_every_rank(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import same_error_everywhere

    cuda.select_device(comm)
    if comm.rank == comm.size - 1:  # as with CuPy 13, which has no bfloat16
        monkeypatch.setattr(mpidp.arrays, "device_bfloat16_problem", lambda: "bfloat16 GPU arrays need CuPy 14 or newer (probe failed)")
    params = {"w": cupy.zeros(3, dtype=cupy.float32), "z": cupy.asarray(np.zeros(4, dtype=mpidp.arrays.BFLOAT16))}
    same_error_everywhere(
        comm,
        lambda: mpidp.DataParallel.initialize(params, comm),
        mpidp.ContractError,
        f"rank {comm.size - 1}: parameter 'z': bfloat16 GPU arrays need CuPy 14 or newer (probe failed)",
    )


torch_gpu = None
try:  # a CUDA build of PyTorch and a GPU: the adapter's CUDA path
    import torch as torch_gpu  # type: ignore[no-redef]

    if not torch_gpu.cuda.is_available():
        torch_gpu = None
except Exception:  # noqa: BLE001 - no torch, or no CUDA: skip
    torch_gpu = None


@pytest.mark.gpu
@pytest.mark.skipif(torch_gpu is None or cupy is None, reason="needs CuPy, a CUDA build of PyTorch and a GPU")
def test_torch_cuda_module_is_reduced_bitwise_as_on_the_host(comm: MPI.Comm, aware: str) -> None:
    """PyTorch CUDA tensors take the core's device path; the same gradients reduced on the CPU give the same bytes."""
    import mpidp.torch

    torch = torch_gpu
    assert torch is not None
    device = cuda.select_device(comm)
    half = torch.bfloat16 if mpidp.arrays.device_bfloat16_problem() is None else torch.float16

    def model() -> Any:
        torch.manual_seed(comm.rank)  # different on every rank: the broadcast makes them equal
        m = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
        m[2].to(half)
        return m

    host, gpu = model(), model().to(f"cuda:{device}")
    with mpidp.torch.DataParallel(host, comm, chunk_bytes=4096) as ref, mpidp.torch.DataParallel(gpu, comm, chunk_bytes=4096) as dp:
        for a, b in zip(host.parameters(), gpu.parameters()):
            assert torch.equal(a, b.cpu())
        torch.manual_seed(100 + comm.rank)
        for p_host, p_gpu in zip(host.parameters(), gpu.parameters()):
            g = torch.randn(p_host.shape).to(p_host.dtype)
            (p_host * g).sum().float().backward()  # .grad = g, through the adapter's hooks
            (p_gpu * g.to(p_gpu.device)).sum().float().backward()
        assert ref.reduce(comm.rank + 1) == dp.reduce(comm.rank + 1)
        torch.cuda.synchronize()
        for (name, a), b in zip(host.named_parameters(), gpu.parameters()):
            assert b.grad.dtype == a.grad.dtype and torch.equal(a.grad, b.grad.cpu()), name
        dp.verify_replicas()


@needs_gpu
def test_reduce_runs_on_the_sessions_device_whichever_is_current(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session on GPU 1 reduced while GPU 0 is current: zeros, copies, casts, streams and events stay on GPU 1."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("MPIDP_CUDA_AWARE", "0")
    rng = np.random.default_rng(3)
    host = {"w": rng.standard_normal(3000).astype(np.float32), "h": rng.standard_normal(50).astype(np.float16), "gone": np.ones(7, np.float32)}
    grads_host = {k: np.random.default_rng(comm.rank).standard_normal(v.shape).astype(v.dtype) for k, v in host.items() if k != "gone"}
    with mpidp.DataParallel.initialize(dict(host), comm, chunk_bytes=4096) as ref:
        expected = ref.reduce({k: v.copy() for k, v in grads_host.items()}, 2, mpidp.MissingGradientPolicy.ZERO).gradients
    with cupy.cuda.Device(1):
        params = {k: cupy.asarray(v) for k, v in host.items()}
        dp = mpidp.DataParallel.initialize(params, comm, chunk_bytes=4096)
        grads = {k: cupy.asarray(v) for k, v in grads_host.items()}
    with dp:
        cupy.cuda.Device(0).use()
        out = dp.reduce(grads, 2, mpidp.MissingGradientPolicy.ZERO).gradients
        assert cupy.cuda.runtime.getDevice() == 0  # the caller's device is current again
        for k, g in out.items():
            assert g.device.id == 1, k
            assert cupy.asnumpy(g).tobytes() == expected[k].tobytes(), k
        dp.zero_gradients()


@needs_gpu
def test_a_cuda_error_from_torchs_stream_is_an_error_on_every_rank(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for torch's stream can report an earlier asynchronous CUDA fault: agreed, not raised on one rank."""
    from conftest import same_error_everywhere

    cuda.select_device(comm)
    params = {"w": cupy.zeros(6, dtype=cupy.float32)}
    with mpidp.DataParallel.initialize(params, comm) as dp:
        if comm.rank == comm.size - 1:

            def fault() -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            monkeypatch.setattr(mpidp.cuda, "wait_for_torch", fault)
        grads = {"w": cupy.ones(6, dtype=cupy.float32)}
        same_error_everywhere(
            comm, lambda: dp.reduce(grads, 1), mpidp.ContractError,
            f"rank {comm.size - 1}: could not read the gradients: RuntimeError: CUDA error: an illegal memory access",
        )
        assert float(grads["w"].sum()) == 6.0  # untouched
        monkeypatch.undo()
        cuda.select_device(comm)
        assert float(dp.reduce(grads, 1).gradients["w"].sum()) == 6.0  # the session still works
