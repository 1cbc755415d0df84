"""benchmarks/scaling_model.py: the formulas, the fit, and docs/scaling.md kept in step with its output.

Pure tests run anywhere; the smoke test runs benchmarks/netbench.py --quick on
2 ranks of this host (no namespaces needed) and fits the model to it. Nothing
here looks at how fast anything was.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import clean_env, load_file
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "multihost-2026-12-04"
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


def _load() -> ModuleType:
    return load_file("scaling_model", ROOT / "benchmarks" / "scaling_model.py")


model = _load()
A, B, G = 5e-6, 8e-11, 1e-12


def test_formulas_agree_where_they_must() -> None:
    n = 100e6
    # two ranks: a ring and recursive halving/doubling are the same exchange
    assert math.isclose(model.ring(2, n, A, B, G), model.rsag(2, n, A, B, G))
    # p ranks: the same bandwidth term, latency 2(p-1) against 2 log2 p
    assert math.isclose(model.ring(1024, n, A, B, G) - model.rsag(1024, n, A, B, G), (2 * 1023 - 2 * 10) * A)
    # a 16-bit allgather: three quarters of the bytes on the wire
    bw = model.rsag(64, n, 0, B, 0)
    assert math.isclose(model.rsag16(64, n, 0, B, 0), 0.75 * bw)
    # a tree sends the whole buffer log2 p times each way
    assert math.isclose(model.tree(8, n, 0, B, 0), 2 * 3 * n * B)


def test_chunking_pays_the_latency_once_per_chunk() -> None:
    chunk, n = 4 << 20, 10 * (4 << 20)
    one = model.ring(256, n, A, B, G)
    chunked = model.chunked(model.ring, chunk)(256, n, A, B, G)
    assert math.isclose(chunked - one, 9 * 2 * 255 * A)
    assert math.isclose(model.chunked(model.ring, chunk)(256, chunk / 2, A, B, G), model.ring(256, chunk / 2, A, B, G))


def _run(alpha: float, beta: float, gamma: float, ratio: float, p: int = 2) -> dict[str, Any]:
    sizes = [8, 512, 4096, 256 << 10, 1 << 20, 4 << 20]
    return {
        "meta": {"world_size": p},
        "pingpong": {str(s): {"min": alpha + s * beta, "median": 2 * (alpha + s * beta)} for s in sizes},
        "allreduce": {str(s): {"min": model.rsag(p, s, alpha, beta, gamma)} for s in sizes},
        "reduce_local_seconds_per_byte": gamma,
        "set": {"fp32_bytes": 1 << 20, "variants": {"mpidp_fp32": {"ratio": ratio, "limit_seconds": 0.01}}},
    }


def test_fit_recovers_the_parameters() -> None:
    fit = model.fit(_run(20e-6, 8e-9, 3e-10, 1.05, p=4))
    assert math.isclose(fit["alpha"], 20e-6 + 512 * 8e-9)  # the median of the small sizes' times
    assert math.isclose(fit["beta"], 8e-9, rel_tol=1e-9)
    assert fit["gamma"] == 3e-10 and fit["p"] == 4
    assert math.isclose(fit["delta"], 0.05 * 0.01 / (1 << 20))


def test_report_checks_its_own_fit_exactly_on_model_data() -> None:
    text = model.report({"synthetic": _run(20e-6, 8e-9, 3e-10, 1.0)}, model.COMPUTE_SECONDS, 5e-6)
    checks = [line for line in text.splitlines() if line.startswith("| synthetic | 2 |") and "MiB" in line]
    assert len(checks) == 2  # 1 and 4 MiB
    for line in checks:
        assert line.split("|")[-2].strip() == "1.00", line
    for name in model.SETS:
        assert f"### {name}:" in text


def test_docs_show_what_the_script_prints() -> None:
    """docs/scaling.md's fitted, checked and predicted tables are the script's output on the committed runs."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling_model.py"), str(RESULTS)], check=True,
                         capture_output=True, text=True).stdout
    assert out == (RESULTS / "model.md").read_text()
    doc = (ROOT / "docs" / "scaling.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| run | p |")]
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc][:3]
    assert (RESULTS / "ratios.md").read_text().strip() in doc


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")
def test_netbench_quick_run_can_be_fitted(tmp_path: Path) -> None:
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "benchmarks" / "netbench.py"),
                        "--quick", "--label", "smoke", "--out", str(tmp_path)], check=False, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=180, env=clean_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout
    run = json.loads((tmp_path / "smoke.json").read_text())
    assert run["meta"]["world_size"] == 2 and run["meta"]["pingpong_peer"] == 1
    assert set(run["set"]["variants"]) == {"raw_rs_ag", "raw_rs_ag16", "mpidp_fp32", "mpidp_mixed"}
    assert all(v["ratio"] > 0 and v["limit_seconds"] > 0 for v in run["set"]["variants"].values())
    assert "| mpidp reduce fp32 | x" in p.stdout
    fitted = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling_model.py"), str(tmp_path)], check=True,
                            capture_output=True, text=True).stdout
    assert "| smoke | 2 |" in fitted and "### GPT-2 small" in fitted
