"""The benchmark keeps working: a --quick run under mpiexec writes a complete, sane result.

It starts its own 4-rank job in a subprocess with a hard timeout, so it runs
in the serial session only (a world of one). Nothing here looks at how fast
anything was: CI never gates on wall-clock time or on a ratio.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
RANKS = 2  # the code paths of any world size; 4 ranks on 2 cores only cost more (the ranks pass runs the library at 4)
#: generous: a quick run takes seconds, but CI machines are shared and slow
TIMEOUT = 240

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")

MPIDP_VARIANTS = [f"mpidp_{mix}_{kind}" for mix in ("fp32", "mixed", "fp16") for kind in ("arrays", "buffers")]
VARIANTS = ["raw_one_call", "raw_scatter", "raw_scatter_half", "raw_divide", "per_tensor", "horovod_fusion", "horovod_synced", "mpidp_initialize", "mpidp_initialize_flat", *MPIDP_VARIANTS]
#: with torch loaded, 16-bit reduces run on torch's casts and are timed once more on NumPy's
NUMPY_CAST_VARIANTS = [f"mpidp_{mix}_{kind}_numpy_casts" for mix in ("mixed", "fp16") for kind in ("arrays", "buffers")]
NUMBA_CAST_VARIANTS = [f"mpidp_{mix}_{kind}_numba_casts" for mix in ("mixed", "fp16") for kind in ("arrays", "buffers")]


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("bench")
    try:
        p = subprocess.run(
            [MPIEXEC, "-n", str(RANKS), sys.executable, "-m", "mpi4py", str(BENCH), "--quick", "--out", str(out)],
            check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
            env=clean_env(), cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the quick benchmark did not finish in {TIMEOUT} s:\n{e.output}")
    assert p.returncode == 0, p.stdout
    path = out / f"quick-np{RANKS}.json"
    assert path.exists(), p.stdout
    return json.loads(path.read_text()), out, p.stdout


def test_quick_run_writes_every_key(quick: tuple[dict[str, Any], Path, str]) -> None:
    result, _, _ = quick
    assert set(result) >= {"meta", "sets", "chunks", "targets"}
    meta = result["meta"]
    assert meta["world_size"] == RANKS and meta["quick"] is True
    assert {"machine", "load_average_start", "load_average_end", "command", "chunk_bytes", "casts"} <= set(meta)
    assert meta["casts"] == ("torch" if meta["torch"] else "numba" if meta["numba"] else "numpy")
    assert meta["casts_end"] == meta["casts"]
    assert set(result["sets"]) == {"gpt2-mini", "tiny"}
    for name, s in result["sets"].items():
        assert {"tensors", "parameters", "fp32_bytes", "limits", "variants"} <= set(s), name
        for limit in ("allreduce", "bcast"):
            assert s["limits"][limit]["best_chunk_bytes"] > 0
            assert all(positive(t) for t in s["limits"][limit]["by_chunk_mib"].values())
        expected = VARIANTS + (["gloo_flat", "gloo_buckets"] if meta["torch"] else [])
        expected += NUMPY_CAST_VARIANTS if meta["casts"] != "numpy" else []
        expected += NUMBA_CAST_VARIANTS if meta["casts"] == "torch" and meta["numba"] else []
        assert sorted(s["variants"]) == sorted(expected), name


def test_quick_run_ratios_are_positive_and_finite(quick: tuple[dict[str, Any], Path, str]) -> None:
    result, _, _ = quick
    for name, s in result["sets"].items():
        for key, v in s["variants"].items():
            for field in ("seconds", "limit_seconds", "ratio", "ratio_min", "ratio_max"):
                assert positive(v[field]), (name, key, field, v[field])
            assert len(v["samples"]["ratios"]) == result["meta"]["reps"]
            assert all(positive(r) for r in v["samples"]["ratios"])
            if key in MPIDP_VARIANTS:
                assert v["memory"]["traced_peak_bytes"] >= 0
    for row in result["chunks"]["rows"]:
        assert row["chunk_bytes"] > 0
        assert all(positive(row[k]) for k in ("raw_ratio", "mpidp_fp32_ratio", "mpidp_mixed_ratio"))
    for t in result["targets"]:
        assert isinstance(t["met"], bool) and t["set"] in result["sets"]


def test_quick_run_prints_the_table_and_draws_the_chart(quick: tuple[dict[str, Any], Path, str]) -> None:
    _, out, stdout = quick
    assert "ratio" in stdout and "targets (issue 5" in stdout
    png = out / "quick.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_torch_run_stays_on_the_casts_it_names(tmp_path: Path) -> None:
    """--no-torch times what a process without torch gets: nothing in the run may import torch and switch the casts."""
    try:
        p = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(BENCH), "--quick", "--no-torch", "--sets", "tiny",
             "--variants", "mpidp_mixed_arrays", "--chunks-set", "tiny", "--no-plot", "--out", str(tmp_path)],
            check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
            env=clean_env(), cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the quick benchmark did not finish in {TIMEOUT} s:\n{e.output}")
    assert p.returncode == 0, p.stdout
    meta = json.loads((tmp_path / "quick-np2.json").read_text())["meta"]
    assert meta["torch"] is False
    assert meta["casts"] != "torch" and meta["casts_end"] == meta["casts"], meta
    if importlib.util.find_spec("torch") is not None:  # its version is still reported, read without importing it
        assert meta["machine"]["versions"]["torch"] == importlib.metadata.version("torch")


def test_notes_show_the_committed_results() -> None:
    """benchmarks/results/NOTES.md's tables are generated from the committed runs, one table per folder, never typed by hand.

    ``benchmarks/results/runs`` holds the latest batch; ``runs-*`` folders keep
    earlier batches (another machine, an earlier version) next to it.
    """
    sys.path.insert(0, str(BENCH.parent))
    import report

    results = ROOT / "benchmarks" / "results"
    folders = sorted(p for p in results.glob("runs*") if p.is_dir())
    assert folders and folders[0].name == "runs", "no committed benchmark results"
    notes = (results / "NOTES.md").read_text()
    assert notes.count("<!-- bench-table:start") == len(folders), "one table in benchmarks/results/NOTES.md per folder of runs"
    for folder in folders:
        found = sorted(folder.glob("*.json"))
        assert found, f"no results in {folder}"
        start, end = f"<!-- bench-table:start {folder.name} -->\n", "<!-- bench-table:end -->"
        assert start in notes, start
        shown = notes.split(start, 1)[1].split(end, 1)[0].strip()
        assert shown == report.markdown(found).strip(), (
            f"regenerate with: python benchmarks/report.py benchmarks/results/{folder.name}/*.json"
        )
    assert (results / "bench.png").exists()


def test_committed_results_carry_no_nan_and_no_temporary_paths() -> None:
    """What is committed under benchmarks/results reads as a result: no nan cells, no scratch folders of the run."""
    bad = []
    for path in sorted((ROOT / "benchmarks" / "results").rglob("*")):
        if path.suffix not in (".json", ".txt", ".md"):
            continue
        text = path.read_text()
        cell = r"[:,\[]\s*-?(NaN|Infinity)\b" if path.suffix == ".json" else r"\b(nan|inf)x?\b"
        if re.search(cell, text) or "/tmp/" in text:
            bad.append(path.relative_to(ROOT).as_posix())
    assert not bad, bad


def test_window_profile_runs_and_names_the_mpi_time() -> None:
    """benchmarks/probes/window_profile.py keeps working: a 2-rank run on the tiny set prints the ratio and the profile."""
    script = ROOT / "benchmarks" / "probes" / "window_profile.py"
    p = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(script), "--set", "tiny", "--reps", "1", "--windows", "2"],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout
    assert "tiny fp32 gradient_buffers, 2 ranks" in p.stdout and "ratio x" in p.stdout, p.stdout
    assert "comm.py" in p.stdout and "(Allreduce)" in p.stdout, p.stdout


@pytest.mark.parametrize("sessions", ["1", "2"])
def test_the_agreement_probe_runs_with_one_session_or_two(sessions: str) -> None:
    """benchmarks/probes/agreement.py: a 2-rank run prints the microseconds per reduce."""
    script = ROOT / "benchmarks" / "probes" / "agreement.py"
    p = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(script), "--calls", "20", "--rounds", "2", "--sessions", sessions],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout
    assert re.search(rf"2 ranks, {sessions} session\(s\): [\d.]+ us per call", p.stdout), p.stdout


GPU_BENCH = ROOT / "benchmarks" / "gpu_bench.py"


@pytest.mark.parametrize("aware", ["0", "1"])
def test_gpu_benchmark_runs_on_the_cpu_stand_in(aware: str) -> None:
    """``scripts/gpu-check``'s benchmark, on tests/fakegpu, so that a GPU session's first run is not its debugging run."""
    env = clean_env(PYTHONPATH=str(ROOT / "tests" / "fakegpu"), MPIDP_CUDA_AWARE=aware)
    try:
        p = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(GPU_BENCH), "--mib", "4", "--tensors", "8", "--reps", "2"],
            check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=env, cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the GPU benchmark did not finish in {TIMEOUT} s:\n{e.output}")
    assert p.returncode == 0, p.stdout
    lines = p.stdout.splitlines()
    assert f"MPI: {'CUDA-aware' if aware == '1' else 'host-staged'} (MPIDP_CUDA_AWARE={aware})" in lines, p.stdout
    assert "not GPU times" in p.stdout
    for name in ("raw", "host", "mpidp"):
        assert any(line.split()[:2] == [name, "median"] and float(line.split()[2]) > 0 for line in lines), (name, p.stdout)
    for limit in ("raw", "host"):
        assert any(line.strip().startswith(f"mpidp / {limit}:") for line in lines), p.stdout


def test_casts_benchmark_times_every_way(tmp_path: Path) -> None:
    """benchmarks/casts.py: every cast, every way this process has (numba's and torch's where installed), positive."""
    import importlib.util

    out = tmp_path / "casts.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "casts.py"), "--sizes", "8192", "--rounds", "2", "--calls", "2", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=TIMEOUT, env=clean_env(),
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["sizes"]["8192"]
    assert set(rows) == {"bfloat16 -> float32", "float16 -> float32", "float32 / w -> bfloat16", "float32 / w -> float16"}
    expected = {"NumPy / ml_dtypes", "mpidp bit arithmetic"}
    expected |= {"mpidp.kernels (numba)"} if importlib.util.find_spec("numba") else set()
    expected |= {"torch"} if importlib.util.find_spec("torch") else set()
    for cast, by in rows.items():
        assert set(by) == expected, cast
        assert all(positive(v["ms"]) for v in by.values()), cast
    report = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "casts.py"), "--report", str(out)], check=False, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert report.returncode == 0, report.stderr
    assert report.stdout.count("\n| 8,192 |") == 4 and "| values | cast | NumPy / ml_dtypes |" in report.stdout


def test_inplace_benchmark_times_both_ways() -> None:
    """benchmarks/probes/inplace.py: in-place and out-of-place sums, both timed, and their ratio printed."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "inplace.py"), "--mib", "0.5", "--chunk-mib", "0.125", "--reps", "2"],
        check=False, capture_output=True, text=True, timeout=TIMEOUT, env=clean_env(),
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("0.5 MB in 0.125 MiB calls, 1 ranks, medians of 2"), run.stdout
    times = {line.split("  ")[1].strip(): float(line.split()[-2]) for line in lines[1:3]}
    assert set(times) == {"in place", "out of place"} and all(t > 0 for t in times.values()), run.stdout
    assert lines[3].strip().startswith("out of place / in place: "), run.stdout


VERSUS = ROOT / "benchmarks" / "versus.py"


def _versus(tmp_path: Path, *args: str, ranks: int = 2) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "versus.json"
    p = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(VERSUS), *args, "--out", str(out)],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout
    result = json.loads(out.read_text())
    assert result["meta"]["world_size"] == ranks
    for r in result["rows"]:
        assert positive(r["ratio"]) and r["ratio_min"] <= r["ratio"] <= r["ratio_max"], r
        assert positive(r["base_seconds"]) and positive(r["checkout_seconds"]), r
    return p, result


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout")
def test_versus_compares_with_a_revision_in_one_process(tmp_path: Path) -> None:
    p, result = _versus(tmp_path, "--rev", "HEAD", "--sets", "tiny", "--reps", "2", "--casts", "numpy")
    assert result["meta"]["rev"] == "HEAD" and result["meta"]["reduction"] is None
    assert {(r["mix"], r["kind"]) for r in result["rows"]} == {(m, k) for m in ("fp32", "mixed") for k in ("buffers", "arrays")}
    assert "this checkout / mpidp at HEAD" in p.stdout
    bad = subprocess.run(
        [MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", str(VERSUS), "--rev", "no-such-revision"],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
    )
    assert bad.returncode != 0 and "cannot read mpidp at 'no-such-revision'" in bad.stdout


def test_versus_compares_two_reductions_of_this_checkout(tmp_path: Path) -> None:
    """What reduction_ab.py did: the same checkout, one side forced to each host reduction."""
    p, result = _versus(tmp_path, "--base-reduction", "allreduce", "--reduction", "reduce_scatter", "--sets", "tiny",
                        "--mixes", "fp16", "--kinds", "buffers", "--reps", "2", "--casts", "numpy")
    assert (result["meta"]["rev"], result["meta"]["base_reduction"], result["meta"]["reduction"]) == (None, "allreduce", "reduce_scatter")
    assert [(r["set"], r["mix"], r["kind"]) for r in result["rows"]] == [("tiny", "fp16", "buffers")]
    assert "this checkout (reduce_scatter) / this checkout (allreduce)" in p.stdout
    same = subprocess.run(
        [MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", str(VERSUS), "--reduction", "auto", "--base-reduction", "auto"],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(), cwd=ROOT,
    )
    assert same.returncode != 0 and "nothing to compare" in same.stdout


def test_benchmarks_readme_lists_every_script() -> None:
    """benchmarks/README.md names every script, and every script or file it names exists."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*.py"))
    assert scripts and not [s for s in scripts if s not in text], "scripts missing from benchmarks/README.md"
    named = set(re.findall(r"(?<![\w/.-])(benchmarks/[\w./-]*\w)", text))
    assert not [n for n in named if not (ROOT / n).exists()], "benchmarks/README.md names paths that do not exist"


@pytest.mark.parametrize(("job", "variant", "keys"), [
    ("step", "sharded", ("step_s", "forward_backward_s", "reduce_and_update_s")),
    ("memory", "replicated", ()),
    ("checkpoint", "mpidp", ("save_s", "load_s")),
])
def test_sharded_benchmark_jobs_report_their_figures(job: str, variant: str, keys: tuple[str, ...]) -> None:
    """benchmarks/sharded.py keeps working: one 2-rank job of each kind on the tiny model prints a sane RESULT line."""
    script = ROOT / "benchmarks" / "sharded.py"
    p = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(script), "--quick", "--job", job, "--variant", variant, "--steps", "2"],
        check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=clean_env(NUMPY_MADVISE_HUGEPAGE="0"),
    )
    assert p.returncode == 0, p.stdout
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["ranks"] == 2 and result["variant"] == variant and len(result["peak_rss_per_rank"]) == 2
    assert all(positive(result[k]) for k in keys), result
    if job != "checkpoint":  # AdamW: two float32 moments per parameter, whole on every rank or cut in two
        nbytes, whole = result["optimizer_bytes_per_rank"], 8 * result["parameters"]
        assert (sum(nbytes) if variant == "sharded" else max(nbytes)) == whole and min(nbytes) >= whole // 2 - 8, result
    else:
        assert result["checkpoint_bytes"] > 12 * result["parameters"], result  # parameters and both moments
