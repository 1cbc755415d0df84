"""Real clients of the "mpidp" backend, unmodified, under ``mpiexec -n 2 python -m mpidp.torch.run``: torchrun's, Accelerate's, a Trainer.

One job runs them all (clients_job.py): a script written for torchrun
(torchrun_script.py), Accelerate's shipped ``test_ops`` and ``test_sync``,
then a tiny Hugging Face ``Trainer`` run (trainer_script.py). Each test asserts that "mpidp" carried the traffic:
the launcher's ``--report`` counts the operations of its groups on every
rank (Accelerate labels its multi-CPU mode "gloo", but finds the launcher's
group made and uses it).
"""

from __future__ import annotations

import functools
import re

import pytest
from test_backend import SERIAL, job

pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@functools.cache
def clients() -> tuple[int, str]:
    rc, out, _ = job(2, "-m", "mpidp.torch.run", "--report", "-m", "clients_job", "--flag", "x", timeout=300)
    return rc, out


def carried(out: str) -> list[int]:
    """Each rank's count of operations over "mpidp", from the launcher's report."""
    found = dict(re.findall(r"mpidp\.torch\.run: rank (\d+): (\d+) operations over 'mpidp'", out))
    return [int(found.get(str(rank), 0)) for rank in (0, 1)]


@SERIAL
def test_the_launcher_runs_a_torchrun_script_over_mpidp() -> None:
    rc, out = clients()
    assert rc == 0, out[-6000:]
    lines = re.findall(r"rank (\d) argv \['--flag', 'x'\] backend mpidp group ProcessGroupMPIDP collectives (\d+)", out)
    assert sorted(rank for rank, _ in lines) == ["0", "1"], out[-6000:]
    assert min(int(n) for _, n in lines) > 0, lines  # DDP's broadcast and all-reduce went through mpidp
    assert out.count("init_process_group('gloo') kept the launcher's 'mpidp' group") == 1, out[-6000:]


@SERIAL
def test_accelerates_test_ops_and_test_sync_pass_over_mpidp() -> None:
    rc, out = clients()
    assert rc == 0, out[-6000:]
    assert "DistributedType.MULTI_CPU" in out and "Num processes: 2" in out, out[-6000:]
    assert "testing sending tensors across devices" in out and "**Test Distributed `no_sync` context manager**" in out, out[-6000:]
    assert min(carried(out)) > 70, out[-3000:]  # 78 per rank: test_ops and test_sync 50, the Trainer 24, the torchrun script 4


@SERIAL
def test_a_tiny_hugging_face_trainer_run_trains_over_mpidp() -> None:
    rc, out = clients()
    assert rc == 0, out[-6000:]
    runs = re.findall(r"trainer rank (\d) world (\d+) mode (\w+) steps (\d+) loss ([\d.]+) params ([0-9a-f]{64})", out)
    assert sorted(r[0] for r in runs) == ["0", "1"], out[-6000:]
    assert all(r[1:4] == ("2", "distributed", "4") for r in runs), runs
    assert runs[0][4:] == runs[1][4:], runs  # the same loss and parameters on both ranks
