#!/usr/bin/env python3
"""Simulate several hosts on one Linux machine and run an MPI job across them.

Each *host* is a network namespace with its own hostname (a UTS namespace),
its own /dev/shm and /etc/hosts (a mount namespace), and one address on a
private bridge. The bridge lives in a namespace of its own (the *switch*),
so nothing is added to the machine's own network: no interface, no address,
no route. MPICH's ``mpiexec`` (hydra) runs on host 0 and starts its proxy on
every other host through ``-launcher ssh -launcher-exec ENTER``, where ENTER
is a small script written for the run that enters that host's namespaces in
place of ssh. MPICH is told to use TCP on the host's ``eth0`` (UCX's tcp
transport by default, libfabric's tcp provider with ``--netmod ofi``); ranks
on one host still share memory with each other, as on a real node.

Everything made is removed on every way out: normal exit, error, Ctrl-C,
SIGTERM, and the watchdog (``--timeout``) that ends a job that hangs; what a
run killed with SIGKILL leaves, the next run removes. Links are shaped with
``--rate`` (tc tbf) and ``--delay`` (tc netem, where the kernel has it).
Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); without them it
says why and exits 0 with "skipped" (so a test run elsewhere is not a failure),
or 77 with ``--strict-skip``.

    multihost.py run [--hosts N] [--ppn K] [--rate 10gbit [--delay 25us]] [--timeout S] -- CMD ...
    multihost.py test [options] -- [N_HOSTS] [pytest args ...]   # what scripts/test-multihost runs
    multihost.py check   # exit 0 where hosts can be made here, else 77 with the reason (scripts/test asks)

Standard library only; run with the Python of the virtual environment whose
mpiexec and mpi4py the job uses (it looks for mpiexec next to sys.executable,
then on PATH).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: names of everything this tool makes start with it (namespaces; interfaces live inside them)
PREFIX = "mpdh"
#: the private subnet of the bridge; it exists only inside this run's namespaces
SUBNET = "10.231.0"
#: exit code of a job the watchdog ended (as timeout(1))
TIMED_OUT = 124
SKIPPED = 77
#: the default multi-host test selection: the hosts pass of tests/ (tests/conftest.py: the collective tests
#: marked transport or hosts, those whose behaviour depends on what separate hosts change)
DEFAULT_TESTS = ["--pass", "hosts", "tests"]


def log(text: str) -> None:
    print(f"multihost: {text}", file=sys.stderr, flush=True)


def why_not() -> str | None:
    """Return why hosts cannot be simulated here, or None if they can (tries one namespace)."""
    if sys.platform != "linux":
        return f"needs Linux network namespaces, this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root, e.g. in CI's container)"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    tried = subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True, text=True, check=False)
    if tried.returncode != 0:
        return f"cannot create UTS and mount namespaces: {tried.stderr.strip() or tried.returncode}"
    return None


def reap_stale() -> list[str]:
    """Remove what an earlier run left when it was killed with SIGKILL: namespaces of a dead ``mpdh<pid>``.

    Only names of this tool (``mpdh<pid>-...``) whose process no longer runs are touched; returns them.
    """
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    stale = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not (name.startswith(PREFIX) and "-" in name and pid.isdigit()) or Path("/proc", pid).exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False).stdout.split()
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        stale.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = folder.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path("/proc", pid).exists() and (folder / "enter").exists():
            shutil.rmtree(folder, ignore_errors=True)
    if stale:
        log(f"removed {len(stale)} namespaces left by killed runs: {' '.join(stale)}")
    return stale


def shaping(rate: str | None, delay: str | None) -> list[str]:
    """The qdisc of a shaped link: netem with a delay (and rate), or tbf for a rate alone (kernels without netem)."""
    if delay:
        return ["netem", "limit", "100000", "delay", delay, *(["rate", rate] if rate else [])]
    assert rate is not None
    bits = _bits_per_second(rate)
    # a burst of 1 ms of traffic, at least 256 KiB: a veth sends segments of up to 64 KiB (GSO), and tbf drops
    # a packet larger than its burst; a queue of 400 ms (50 MB at 1 Gbit/s) so that TCP is slowed, not made to
    # retransmit (with 50 ms, a 16 MiB message at 1 Gbit/s took twice its time)
    burst = max(bits // 8 // 1000, 256 << 10)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "400ms"]


def _bits_per_second(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"rate must be a number and one of {', '.join(units)} (e.g. 10gbit), got {rate!r}")


def why_no_shaping(rate: str | None, delay: str | None) -> str | None:
    """Return why this kernel cannot shape links as asked (tried on a throwaway veth), or None."""
    if not rate and not delay:
        return None
    if shutil.which("tc") is None:
        return "needs `tc` (iproute2) to shape links"
    probe = f"{PREFIX}{os.getpid()}-tc"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=True)
    try:
        subprocess.run(["ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb"], capture_output=True,
                       check=True)
        tried = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "va", "root", *shaping(rate, delay)],
                               capture_output=True, text=True, check=False)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if tried.returncode == 0:
        return None
    kind = "netem" if delay else "tbf"
    return f"cannot shape links with tc {kind} here ({tried.stderr.strip()})" + (
        "; this kernel lacks sch_netem: a delay cannot be simulated, a rate alone can (tbf)" if delay else "")


def mpiexec_path() -> str:
    here = Path(sys.executable).with_name("mpiexec")
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("multihost: no mpiexec next to this python nor on PATH (source scripts/venv.sh test mpich)")
    return found


def netmod_env(netmod: str) -> dict[str, str]:
    """Environment that makes MPICH carry inter-host traffic over TCP on eth0."""
    if netmod == "ucx":
        return {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
    if netmod == "ofi":
        return {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}
    raise ValueError(f"netmod must be ucx or ofi, got {netmod!r}")


#: the launcher's own variables, dropped so that a job started from inside another MPI job starts clean
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_", "OMPI_", "PRTE_")


class Cluster:
    """N simulated hosts on a private bridge; a context manager that always removes what it made."""

    def __init__(self, hosts: int, rate: str | None = None, delay: str | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        self.n = hosts
        self.rate, self.delay = rate, delay
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.namespaces = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.hostnames = [f"{PREFIX}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.made: list[str] = []
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))

    # --- building -----------------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def _netns(self, name: str) -> None:
        self._ip("netns", "add", name)
        self.made.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")

    def __enter__(self) -> Cluster:  # noqa: PYI034 - Self needs Python 3.11
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self._netns(self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._netns(ns)
            # made directly inside the namespaces: the machine's own namespace never sees them
            self._ip("link", "add", "name", f"v{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            if self.rate or self.delay:
                # the host's NIC: its egress is shaped, so a message between two hosts pays the delay once
                subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *shaping(self.rate, self.delay)],
                               check=True, capture_output=True, text=True)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        (self.dir / "hosts").write_text(hosts)
        enter = self.dir / "enter"
        cases = "\n".join(f"  {a}|{h}) i={i} ;;" for i, (a, h) in enumerate(zip(self.addresses, self.hostnames)))
        enter.write_text(
            "#!/bin/sh\n"
            "# hydra's ssh stand-in for this run: enter HOST's namespaces and run the command there\n"
            '[ "$1" = -x ] && shift\n'
            'case "$1" in\n'
            f"{cases}\n"
            '  *) echo "enter: unknown host $1" >&2; exit 255 ;;\n'
            "esac\n"
            "shift\n"
            f'exec {shlex.quote(str(self.dir / "host"))} "$i" sh -c "$*"\n'
        )
        host = self.dir / "host"
        host.write_text(
            "#!/bin/sh\n"
            "# host INDEX CMD...: run CMD as host INDEX (its network, hostname, /dev/shm and /etc/hosts)\n"
            'i=$1; shift\n'
            f"ns={self.tag}-h$i\n"
            f"name={PREFIX}-h$i\n"
            'exec ip netns exec "$ns" unshare --uts --mount --propagation private sh -c \'\n'
            '  hostname "$0" && mount -t tmpfs -o mode=1777 mpdh-shm /dev/shm &&\n'
            f'  mount --bind {shlex.quote(str(self.dir / "hosts"))} /etc/hosts && exec "$@"\' "$name" "$@"\n'
        )
        for script in (enter, host):
            script.chmod(0o755)
        log(f"{self.n} hosts {' '.join(self.hostnames)} on {SUBNET}.0/24 (namespaces {self.tag}-*)"
            + (f", links shaped: rate {self.rate}, delay {self.delay}" if self.rate or self.delay else ""))

    # --- running ------------------------------------------------------------------------------
    def mpiexec(self, command: list[str], ppn: int, netmod: str = "ucx", extra_env: dict[str, str] | None = None) -> list[str]:
        """The argv that runs ``command`` with ``ppn`` ranks on every host, started from host 0."""
        env = {**netmod_env(netmod), "GLOO_SOCKET_IFNAME": "eth0", "MPDH_HOSTS": ",".join(self.hostnames),
               "MPDH_PPN": str(ppn), **(extra_env or {})}
        genv = [x for k, v in env.items() for x in ("-genv", k, v)]
        return [str(self.dir / "host"), "0", mpiexec_path(), "-launcher", "ssh", "-launcher-exec", str(self.dir / "enter"),
                "-iface", "eth0", "-hosts", ",".join(self.addresses), "-ppn", str(ppn), "-n", str(ppn * self.n),
                *genv, *command]

    def run(self, argv: list[str], timeout: float) -> int:
        """Run ``argv`` (output to ours); end it and everything in the hosts after ``timeout`` seconds."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"watchdog: the job ran past {timeout:g} s; ending it and every process in the hosts")
            return TIMED_OUT
        finally:
            if proc.poll() is None:
                _kill_group(proc.pid)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill_group(proc.pid, signal.SIGKILL)
                    proc.wait()

    # --- removing -----------------------------------------------------------------------------
    def _pids(self) -> list[int]:
        pids: list[int] = []
        for ns in self.made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
            pids += [int(p) for p in out.split()]
        return pids

    def close(self) -> None:
        """End every process still in the hosts, delete the namespaces (and with them the links) and files."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while pids and self._pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        left = [ns for ns in self.made if Path("/run/netns", ns).exists()]
        self.made = left
        shutil.rmtree(self.dir, ignore_errors=True)
        if left:
            log(f"could not remove {' '.join(left)}")
        else:
            log(f"removed namespaces {self.tag}-* and {self.dir}")

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_group(pgid: int, sig: signal.Signals = signal.SIGTERM) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def skip(reason: str, strict: bool) -> int:
    print(f"multihost: skipped: {reason}", flush=True)
    return SKIPPED if strict else 0


def pytest_command(args: list[str]) -> list[str]:
    """``python -m mpi4py -m pytest --with-mpi`` over the hosts pass's tests, with the hosts line plugin.

    The hosts pass of the tests directory is added unless an argument names an existing path, so
    ``-k``, ``-x`` and friends narrow the default selection and a file (all of its tests) replaces it.
    """
    paths = [] if any(Path(a.split("::")[0]).exists() for a in args if not a.startswith("-")) else DEFAULT_TESTS
    return [sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "--with-mpi", "-p", "hostsline", *paths, *args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("run", "test"):
        p = sub.add_parser(name)
        p.add_argument("--ppn", type=int, default=2, help="ranks per host (default 2)")
        p.add_argument("--rate", help="rate of every host's link (its egress), e.g. 10gbit: tc tbf, or netem with --delay")
        p.add_argument("--delay", help="one-way delay of every host's link, e.g. 25us (tc netem; needs sch_netem)")
        p.add_argument("--timeout", type=float, default=600.0,
                       help="watchdog: seconds before the job and everything in the hosts is ended (default 600)")
        p.add_argument("--netmod", choices=("ucx", "ofi"), default="ucx",
                       help="MPICH netmod that carries inter-host traffic over TCP (default ucx)")
        p.add_argument("--strict-skip", action="store_true", help="exit 77 instead of 0 where hosts cannot be made")
    sub.add_parser("check", help="exit 0 where hosts can be made here, else say why and exit 77")
    sub.choices["run"].add_argument("--hosts", type=int, default=2)
    sub.choices["run"].add_argument("command", nargs=argparse.REMAINDER)
    sub.choices["test"].add_argument("rest", nargs=argparse.REMAINDER, help="[N_HOSTS] [pytest args]")
    opts = parser.parse_args(argv)

    if opts.what == "check":
        reason = why_not()
        print(f"multihost: {'hosts can be made here' if reason is None else f'cannot make hosts here: {reason}'}", flush=True)
        return 0 if reason is None else SKIPPED
    if opts.what == "run":
        command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
        if not command:
            parser.error("run: give the command after --")
        hosts = opts.hosts
        extra: dict[str, str] = {}
    else:
        rest = opts.rest[1:] if opts.rest[:1] == ["--"] else opts.rest
        hosts = 2
        if rest and rest[0].isdigit():
            hosts, rest = int(rest[0]), rest[1:]
        command = pytest_command(rest)
        extra = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests" / "multihost"), os.environ.get("PYTHONPATH")]))}
    if hosts < 2 and opts.what == "test":
        parser.error(f"N_HOSTS must be at least 2, got {hosts}")
    reason = why_not() or why_no_shaping(opts.rate, opts.delay)
    if reason is not None:
        return skip(reason, opts.strict_skip)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    reap_stale()
    with Cluster(hosts, opts.rate, opts.delay) as cluster:
        argv = cluster.mpiexec(command, opts.ppn, opts.netmod, extra)
        log(f"{opts.ppn * hosts} ranks, {opts.ppn} per host, TCP via {opts.netmod}, watchdog {opts.timeout:g} s")
        code = cluster.run(argv, opts.timeout)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        log(f"interrupted ({e or 'Ctrl-C'}); everything it made is removed")
        sys.exit(130)
