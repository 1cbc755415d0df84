"""Many hosts on one machine (scripts/test-multihost): what only a real network can show.

Two kinds of test live here:

- *Across hosts*: collective tests that run only inside ``scripts/test-multihost``
  (which sets ``MPDH_HOSTS``), where every rank's host is a network namespace with
  its own hostname: MPI sees different hosts, one shared-memory group per host,
  node-local rank and device selection per host, bytes that cross ``eth0``, and a
  launch check that stays silent in a real world.
- *Of the harness*: serial tests (a world of one) that start their own simulated
  hosts through scripts/multihost.py, and skip where namespaces cannot be made:
  the hosts line and the clean-up, the watchdog, an exception or a kill on one
  host ending the ranks on the others, and a world of one per process spread over
  hosts that the launch check reports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from conftest import clean_env, load_file
from mpi4py import MPI

import mpidp
from mpidp import cuda, launch

ROOT = Path(__file__).resolve().parent.parent
HOSTS = [h for h in os.environ.get("MPDH_HOSTS", "").split(",") if h]
PPN = int(os.environ.get("MPDH_PPN", "0") or 0)


def across_hosts(test: Any) -> Any:
    """A test of the hosts pass (``hosts``) that runs across simulated hosts only."""
    return pytest.mark.hosts(pytest.mark.skipif(not HOSTS, reason="runs across simulated hosts only (scripts/test-multihost)")(test))


def _driver() -> ModuleType:
    return load_file("mpdh_driver", ROOT / "scripts" / "multihost.py")


# ------------------------------------------------------------------ across hosts (under scripts/test-multihost)


@across_hosts
def test_ranks_run_on_different_hosts(comm: MPI.Comm) -> None:
    names = comm.allgather((MPI.Get_processor_name(), socket.gethostname()))
    assert all(mpi == os_name for mpi, os_name in names), names
    # hydra's -ppn fills each host in turn: ranks 0..ppn-1 on the first, and so on
    assert [mpi for mpi, _ in names] == [HOSTS[r // PPN] for r in range(comm.size)], names
    assert len({mpi for mpi, _ in names}) == len(HOSTS) >= 2


@across_hosts
def test_shared_memory_split_gives_one_group_per_host(comm: MPI.Comm) -> None:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        members = tuple(node.allgather(comm.rank))
        assert node.size == PPN
    finally:
        node.Free()
    hosts = comm.allgather(MPI.Get_processor_name())
    groups = set(comm.allgather(members))
    assert len(groups) == len(HOSTS), groups
    for group in groups:
        assert len({hosts[r] for r in group}) == 1, (group, hosts)  # a group never spans two hosts
    assert sorted(r for g in groups for r in g) == list(range(comm.size))


@across_hosts
def test_node_local_rank_counts_within_each_host(comm: MPI.Comm) -> None:
    mine = (MPI.Get_processor_name(), comm.rank, cuda.local_rank(comm))
    every = comm.allgather(mine)
    for host, rank, local in every:
        same_host = [r for h, r, _ in every if h == host]
        assert local == same_host.index(rank), every  # not the world rank: 0..ppn-1 on every host
    assert mine[2] == int(os.environ["MPI_LOCALRANKID"])  # and what the launcher says


@across_hosts
def test_device_selection_counts_within_each_host(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """select_device picks node-local rank modulo the GPU count (GPUs: the CPU stand-in for CuPy)."""
    for gpus in (PPN, 1):
        monkeypatch.setenv("MPIDP_FAKE_GPUS", str(gpus))
        with _fake_cupy(monkeypatch):
            device = cuda.select_device(comm)
            import cupy

            assert getattr(cupy, "_mpidp_fake", False) and cupy.cuda.runtime.getDevice() == device
        every = comm.allgather((MPI.Get_processor_name(), device))
        for host in HOSTS:
            on_host = [d for h, d in every if h == host]
            assert on_host == [r % gpus for r in range(PPN)], (gpus, every)


class _fake_cupy:
    """Import the CPU stand-in for CuPy as ``cupy`` for the block, then forget it again."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def __enter__(self) -> None:
        self.before = {k for k in sys.modules if k == "cupy" or k.startswith("cupy.")}
        for name in self.before:
            self.monkeypatch.delitem(sys.modules, name)
        self.monkeypatch.syspath_prepend(str(ROOT / "tests" / "fakegpu"))

    def __exit__(self, *exc: object) -> None:
        for name in [k for k in sys.modules if k == "cupy" or k.startswith("cupy.")]:
            if name not in self.before:
                del sys.modules[name]


def _tx_bytes(interface: str = "eth0") -> int:
    """Bytes this host (network namespace) has sent on ``interface``."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])
    raise AssertionError(f"no {interface} in /proc/net/dev")


@across_hosts
def test_reduce_moves_its_bytes_over_the_network(comm: MPI.Comm) -> None:
    n = 4 << 20  # 16 MiB of float32 gradients
    params = {"w": np.zeros(n, np.float32)}
    with mpidp.DataParallel.initialize(params, comm) as dp:
        grads = {"w": np.full(n, comm.rank + 1, np.float32)}
        comm.Barrier()
        before = _tx_bytes()
        out = dp.reduce(grads, 1)
        comm.Barrier()
        sent = _tx_bytes() - before
    expected = sum(range(1, comm.size + 1)) / comm.size
    assert np.array_equal(out.gradients["w"], np.full(n, expected, np.float32))
    per_host = dict(comm.allgather((MPI.Get_processor_name(), sent)))
    # whatever the algorithm, every host must send at least half its contribution to the others
    assert all(b >= n * 4 // 2 for b in per_host.values()), per_host


@across_hosts
def test_launch_check_is_silent_in_a_world_spread_over_hosts(comm: MPI.Comm) -> None:
    assert os.environ.get("PMI_SIZE") == str(comm.size)
    assert launch.check_world(comm.size, MPI.Get_library_version()) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mpidp.DataParallel.initialize({"w": np.zeros(3, np.float32)}, comm):
            pass
    assert not [w for w in caught if issubclass(w.category, launch.LaunchWarning)]


# ------------------------------------------------------------------ the harness itself (a world of one)

serial = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own simulated hosts")


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    module = _driver()
    reason = module.why_not()
    if reason is not None:
        pytest.skip(f"cannot simulate hosts here: {reason}")
    return module


def _hosts(args: list[str], timeout: float = 120) -> tuple[int, str, float]:
    """Run scripts/multihost.py with ``args``; return (exit code, output, seconds), checking the clean-up."""
    start = time.monotonic()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "multihost.py"), *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout, env=clean_env(), check=False)
    _assert_removed(p.stdout)
    return p.returncode, p.stdout, time.monotonic() - start


def _assert_removed(out: str) -> None:
    tag = re.search(r"namespaces (mpdh\d+)-\*", out)
    assert tag, out
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert tag.group(1) + "-" not in left, left
    assert f"removed namespaces {tag.group(1)}-*" in out, out
    assert not list(Path("/tmp").glob(tag.group(1) + "-*"))


@serial
def test_script_prints_the_hosts_and_removes_everything(driver: ModuleType) -> None:
    p = subprocess.run([str(ROOT / "scripts" / "test-multihost"), "2", "tests/test_multihost.py", "-k", "different_hosts"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=clean_env(), check=False)
    assert p.returncode == 0, p.stdout
    assert "hosts: mpdh-h0 mpdh-h0 mpdh-h1 mpdh-h1" in p.stdout, p.stdout
    assert re.search(r"\b1 passed", p.stdout), p.stdout
    _assert_removed(p.stdout)


@serial
def test_check_says_hosts_can_be_made_and_leaves_no_namespace(driver: ModuleType) -> None:
    """What scripts/test asks before its transport pass (the hosts pass runs those tests): 0 here."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "multihost.py"), "check"], capture_output=True, text=True,
                       timeout=60, env=clean_env(), check=False)
    assert (p.returncode, p.stdout) == (0, "multihost: hosts can be made here\n"), p
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "-probe" not in left, left  # its one trial namespace


@serial
def test_watchdog_ends_a_hung_job_and_removes_everything(driver: ModuleType) -> None:
    # a rank that ignores SIGTERM: only the clean-up's SIGKILL of every process in the hosts ends it
    hang = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('hanging', flush=True); time.sleep(300)"
    code, out, seconds = _hosts(["run", "--timeout", "5", "--", sys.executable, "-c", hang])
    assert code == driver.TIMED_OUT, out
    assert out.count("hanging") == 4 and "watchdog: the job ran past 5 s" in out, out
    assert seconds < 5 + 20, f"took {seconds:.1f} s"


@serial
def test_namespaces_of_a_killed_run_are_removed_by_the_next(driver: ModuleType) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    left = f"{driver.PREFIX}{dead}-h0"
    subprocess.run(["ip", "netns", "add", left], check=True)
    try:
        code, out, _ = _hosts(["run", "--", "true"])
        assert code == 0, out
        assert f"namespaces left by killed runs: {left}" in out, out
        assert left not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", left], capture_output=True, check=False)


@serial
def test_the_torch_distributed_launcher_spans_hosts(driver: ModuleType) -> None:
    """``python -m mpidp.torch.run`` on 2 hosts x 2 ranks: torchrun's variables per host (node-local ranks, the store at
    rank 0's host name), and DDP, all_gather and a 4 MiB all_reduce over the ``"mpidp"`` backend, across the hosts."""
    pytest.importorskip("torch")
    script = ROOT / "tests" / "torch_distributed" / "hosts_script.py"
    code, out, _ = _hosts(["run", "--timeout", "240", "--", sys.executable, "-m", "mpidp.torch.run", str(script)], timeout=300)
    assert code == 0, out
    found = sorted(re.findall(r"rank (\d)/4 local (\d)/2 host (\S+) master (\S+) backend mpidp ok True", out))
    assert found == [("0", "0", "mpdh-h0", "127.0.0.1"), ("1", "1", "mpdh-h0", "127.0.0.1"),
                     ("2", "0", "mpdh-h1", "mpdh-h0"), ("3", "1", "mpdh-h1", "mpdh-h0")], out


def _fault_job(mode: str) -> tuple[int, str, float]:
    """The fault script of test_faults.py on 2 hosts x 2 ranks; seconds from the fault to the end."""
    code, out, _ = _hosts(["run", "--", sys.executable, str(ROOT / "tests" / "faults" / "train.py"), mode])
    end = time.time()
    fault = [float(line.rsplit(" at ", 1)[1]) for line in out.splitlines() if line.startswith("rank ") and " at " in line]
    assert fault, out
    return code, out, end - fault[0]


@serial
def test_an_exception_on_one_host_ends_the_ranks_on_the_other(driver: ModuleType) -> None:
    code, out, after = _fault_job("raise")  # rank 2: the first rank of the second host
    assert code != 0, out
    assert "mpidp: uncaught RuntimeError on rank 2; aborting the MPI job" in out and "boom outside mpidp" in out, out
    assert "done" not in out, out
    assert after <= 5, f"the job took {after:.1f} s to end after the exception"


@serial
def test_a_rank_killed_on_one_host_ends_the_ranks_on_the_other(driver: ModuleType) -> None:
    code, out, after = _fault_job("kill")  # rank 1: on the first host; ranks 2 and 3 wait on the second
    assert code != 0, out
    assert "done" not in out, out
    assert after <= 10, f"the job took {after:.1f} s to end after the kill"


@serial
def test_singletons_spread_over_hosts_are_reported(driver: ModuleType, tmp_path: Path) -> None:
    """Processes the launcher started as 4 that each see a world of 1 (its PMI connection hidden) are reported.

    Each process writes what it saw to a file of its own (the hosts share this file system), so that the
    check does not depend on how mpiexec interleaves the output of four processes.
    """
    script = (
        "import json, os, socket, sys, warnings\n"
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "import mpidp\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    mpidp.DataParallel.initialize({'w': np.zeros(2, np.float32)}, MPI.COMM_WORLD).close()\n"
        "texts = [str(w.message) for w in caught if issubclass(w.category, mpidp.launch.LaunchWarning)]\n"
        "seen = {'host': socket.gethostname(), 'world': MPI.COMM_WORLD.Get_size(), 'warnings': texts}\n"
        "with open(os.path.join(sys.argv[1], f'{os.getpid()}.json'), 'w') as f:\n"
        "    json.dump(seen, f)\n"
    )
    hidden = ["env", "-u", "PMI_FD", "-u", "PMI_PORT", "-u", "PMI_RANK", "-u", "PMI_ID"]
    code, out, _ = _hosts(["run", "--", *hidden, sys.executable, "-c", script, str(tmp_path)])
    assert code == 0, out
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert sorted(s["host"] for s in seen) == ["mpdh-h0", "mpdh-h0", "mpdh-h1", "mpdh-h1"], (seen, out)
    for s in seen:
        assert s["world"] == 1 and len(s["warnings"]) == 1, s
        assert s["warnings"][0].startswith("mpidp: MPI sees a world of 1 process, but PMI_SIZE=4"), s
        assert "different MPI" in s["warnings"][0], s


@serial
def test_skips_with_the_reason_where_hosts_cannot_be_made() -> None:
    """Without `ip` on PATH (or, as root, also as an ordinary user): a clear reason, exit 0, or 77 when strict."""
    script = str(ROOT / "scripts" / "multihost.py")
    env = clean_env(PATH="/nonexistent")
    for strict, expected in (([], 0), (["--strict-skip"], 77)):
        p = subprocess.run([sys.executable, script, "run", *strict, "--", "true"], capture_output=True, text=True,
                           env=env, timeout=60, check=False)
        assert p.returncode == expected, p
        assert re.fullmatch(r"multihost: skipped: needs (root|`ip` on PATH).*\n", p.stdout), p.stdout
    # what scripts/test asks before its transport pass: 77 and the reason here, 0 where hosts can be made
    p = subprocess.run([sys.executable, script, "check"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert p.returncode == 77 and re.fullmatch(r"multihost: cannot make hosts here: needs (root|`ip` on PATH).*\n", p.stdout), p
    if os.geteuid() == 0 and Path("/usr/bin/setpriv").exists():
        # an ordinary user may not reach the checkout (a clone under /root, a 0700 temporary directory), nor the
        # virtual environment in it: a world-readable copy of the script (standard library only), run by the
        # interpreter the environment was made from, in a directory of the copy's
        with tempfile.TemporaryDirectory() as folder:
            os.chmod(folder, 0o755)
            copy = Path(folder) / "multihost.py"
            shutil.copyfile(script, copy)
            copy.chmod(0o644)
            python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
            p = subprocess.run(["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", str(copy),
                                "test", "--", "2"], capture_output=True, text=True, env=clean_env(), timeout=60, check=False,
                               cwd=folder)
        assert p.returncode == 0 and "multihost: skipped: needs root" in p.stdout, p


def test_pytest_command_keeps_the_default_selection_unless_a_path_is_given() -> None:
    module = _driver()
    assert module.pytest_command(["-k", "reduce", "-x"])[-7:] == ["hostsline", "--pass", "hosts", "tests", "-k", "reduce", "-x"]
    chosen = module.pytest_command(["tests/test_multihost.py::test_ranks_run_on_different_hosts", "-q"])
    assert "tests" not in chosen and "--pass" not in chosen and chosen[-2] == "tests/test_multihost.py::test_ranks_run_on_different_hosts"


def test_netmod_environment_names_tcp_on_eth0() -> None:
    module = _driver()
    assert module.netmod_env("ucx")["UCX_TLS"] == "tcp,self" and module.netmod_env("ucx")["UCX_NET_DEVICES"] == "eth0"
    assert module.netmod_env("ofi")["FI_PROVIDER"] == "tcp"
    with pytest.raises(ValueError, match="netmod must be ucx or ofi, got 'ib'"):
        module.netmod_env("ib")
