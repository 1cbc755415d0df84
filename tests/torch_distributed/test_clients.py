"""Real clients of the "mpidp" backend, unmodified, under ``mpiexec -n 2 python -m mpidp.torch.run``: Accelerate's test scripts, a Trainer.

Each asserts that "mpidp" carried the traffic: the launcher's ``--report``
counts the operations of its groups on every rank (Accelerate labels its
multi-CPU mode "gloo", but finds the launcher's group made and uses it).
"""

from __future__ import annotations

import re

import pytest
from test_backend import SERIAL, job

pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def carried(out: str) -> list[int]:
    """Each rank's count of operations over "mpidp", from the launcher's report."""
    found = dict(re.findall(r"mpidp\.torch\.run: rank (\d+): (\d+) operations over 'mpidp'", out))
    return [int(found.get(str(rank), 0)) for rank in (0, 1)]


@SERIAL
def test_accelerates_test_ops_and_test_sync_pass_over_mpidp() -> None:
    rc, out, _ = job(2, "-m", "mpidp.torch.run", "--report", "accelerate_scripts.py", timeout=240)
    assert rc == 0, out[-6000:]
    assert "DistributedType.MULTI_CPU" in out and "Num processes: 2" in out, out[-6000:]
    assert "testing sending tensors across devices" in out and "**Test Distributed `no_sync` context manager**" in out, out[-6000:]
    assert min(carried(out)) > 20, out[-3000:]


@SERIAL
def test_a_tiny_hugging_face_trainer_run_trains_over_mpidp() -> None:
    rc, out, _ = job(2, "-m", "mpidp.torch.run", "--report", "trainer_script.py", timeout=240)
    assert rc == 0, out[-6000:]
    lines = [line.split() for line in out.splitlines() if line.startswith("trainer rank ")]
    assert sorted(int(x[2]) for x in lines) == [0, 1], out[-6000:]
    assert all(x[4] == "2" and x[6] == "distributed" and x[8] == "4" for x in lines), lines
    assert lines[0][-1] == lines[1][-1] and lines[0][-3] == lines[1][-3], lines  # the same parameters and loss on both ranks
    assert min(carried(out)) > 8, out[-3000:]
