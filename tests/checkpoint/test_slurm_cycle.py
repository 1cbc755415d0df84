"""The Slurm template's checkpoint cycle: the warning signal reaches the ranks and requeues the job; a requeued job resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent.parent
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"

pytestmark = pytest.mark.mpi_skip

#: a stand-in srun: records its arguments, then waits for SIGUSR1 as the ranks would, and says it got it
SRUN = """#!/bin/bash
printf "%s\\n" "$@" > "{log}"
trap 'echo got USR1 >> "{log}"; exit 0' USR1
touch "{log}.started"
for i in $(seq 600); do sleep 0.1; done
exit 3
"""


def stand_ins(tmp_path: Path) -> dict[str, str]:
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    (bin_dir / "srun").write_text(SRUN.format(log=tmp_path / "srun.log"))
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path / "scontrol.log"}"\n')
    for f in (venv / "bin" / "python", bin_dir / "srun", bin_dir / "scontrol"):
        f.chmod(0o755)
    env = clean_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", MPIDP_VENV=str(venv), SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="42",
               SLURM_JOB_NAME="train", MPIDP_CHECKPOINTS=str(tmp_path / "ckpt"))
    return env


def test_the_warning_reaches_the_ranks_and_requeues_the_job(tmp_path: Path) -> None:
    env = stand_ins(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step-00000005\n")  # a requeued job: it resumes
    job = subprocess.Popen(["bash", str(SBATCH), "--steps", "9"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "srun.log.started").exists():
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, out
    args = (tmp_path / "srun.log").read_text().splitlines()
    assert ["--save", str(tmp_path / "ckpt"), "--resume", str(tmp_path / "ckpt"), "--steps", "9", "got USR1"] == args[-7:], args
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "42"]
    assert "resuming from" in out and "step-00000005" in out, out
