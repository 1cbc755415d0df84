"""benchmarks/train_step.py keeps working: a --quick 2-rank run writes a complete, sane result.

It starts its own MPI job in a subprocess with a hard timeout, so it runs in
the serial session only (a world of one). Nothing here looks at how fast
anything was: CI never gates on wall-clock time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env
from mpi4py import MPI

from mpidp import exact

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "train_step.py"
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
TIMEOUT = 240
VARIANTS = {"local", "mpidp", "mpidp_readme", "mpidp_exact", "mpidp_exact_thread", "mpidp_overlap", "mpidp_hooks", "mpidp_thread", "mpidp_thread_weight", "ddp_gloo", "horovod"}

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_quick_run_times_every_variant_in_parts(tmp_path: Path) -> None:
    try:
        p = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(SCRIPT), "--quick", "--out", str(tmp_path)],
            check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the quick train-step benchmark did not finish in {TIMEOUT} s:\n{e.output}")
    assert p.returncode == 0, p.stdout
    result = json.loads((tmp_path / "quick-train-step-np2.json").read_text())
    assert result["meta"]["world_size"] == 2 and result["meta"]["quick"] is True
    # the install behind the figures (issue 41): numba or not, and whose exact passes ran
    numba = exact.route("numba") == "numba"  # numba importable and its passes built (scripts/test hides it in one run)
    assert result["meta"]["numba"] is numba
    assert result["meta"]["exact_kernels"] == ("numba" if numba else "torch")
    assert set(result["models"]) == {"gpt2-tiny", "resnet-tiny", "offcpu-gpt2-tiny"}
    off = result["models"]["offcpu-gpt2-tiny"]
    assert off["offcpu"]["real_model"] == "gpt2-tiny" and positive(off["offcpu"]["backward_sleep"])
    assert off["parameters"] == result["models"]["gpt2-tiny"]["parameters"]  # the same parameters as the real model
    for name, m in result["models"].items():
        assert m["parameters"] > 0 and m["gradient_bytes"] == 4 * m["parameters"], name
        assert all(positive(t) for t in m["limits"].values()), name
        assert set(m["variants"]) == VARIANTS, name
        for v, r in m["variants"].items():
            for part in ("step", "forward_backward", "optimizer", "step_vs_ddp_gloo", "step_vs_local"):
                assert positive(r[part]), (name, v, part, r[part])
            assert r["reduce_after_backward"] >= 0
            assert len(r["samples"]) == result["meta"]["steps"]
            assert r["step"] >= r["forward_backward"]
        assert m["variants"]["mpidp_thread"]["overlap_mode"] == "thread" and m["variants"]["mpidp_hooks"]["overlap_mode"] == "hooks"
        assert m["variants"]["mpidp_exact_thread"]["overlap_mode"] == "thread" and m["variants"]["mpidp_exact"]["overlap_mode"] == "off"
        spare = len(os.sched_getaffinity(0)) >= 2 * 2  # 2 ranks, each 1 torch thread + a communication thread
        assert m["variants"]["mpidp_overlap"]["overlap_mode"] == ("thread" if spare else "off")  # no core to spare: the plain path
        assert m["variants"]["mpidp"]["overlap_mode"] == "off"
        assert name in p.stdout
    assert "vs DDP" in p.stdout
    table = subprocess.run(
        [sys.executable, str(SCRIPT), "--markdown", str(tmp_path / "quick-train-step-np2.json")],
        check=True, stdout=subprocess.PIPE, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
    ).stdout
    for name, m in result["models"].items():  # the docs' table: a row per model and variant, the plain path's left as the base
        for v, r in m["variants"].items():
            label = f"{v} ({r['overlap_mode']})" if v == "mpidp_overlap" else v
            row = f"| {name} | {label} | {r['step'] * 1e3:.1f} | {r['forward_backward'] * 1e3:.1f} | {r['reduce_after_slowest_backward'] * 1e3:.1f} |"
            assert row in table, (name, v, table)
        assert f"| {name} | mpidp_thread | " in table and f"{m['variants']['mpidp_thread']['left_vs_mpidp']:.2f}x" in table


def test_the_overlap_timeline_probe_shows_the_threads_calls_and_the_agreement() -> None:
    try:
        p = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "benchmarks" / "probes" / "overlap_timeline.py"),
             "--model", "offcpu-gpt2-tiny", "--steps", "2", "--show", "1"],
            check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the overlap timeline did not finish in {TIMEOUT} s:\n{e.output}")
    assert p.returncode == 0, p.stdout
    assert "step 1: backward ended at" in p.stdout and "step 0:" not in p.stdout, p.stdout
    for label in ("queue", "call", "checks", "agreement", "tail"):
        assert f"  {label}" in p.stdout, (label, p.stdout)
