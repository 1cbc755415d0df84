"""README.md and docs/ cannot drift from the code: their Python blocks run, their commands, paths, tables and links
are checked, and the README stays short.

A block is tagged by an HTML comment on the line just above its fence::

    <!-- readme-test: mpiexec=4 requires=mpidp.torch after=setup -->

- ``run``: run in a subprocess, a world of one; ``mpiexec=N``: under
  ``mpiexec -n N python -m mpi4py``; ``torchrun=N``: under ``torchrun
  --standalone --nproc-per-node N``.
- ``name=X``: a set-up block that other blocks of the same file prepend with ``after=X``.
- ``requires=MOD,...``: the block needs these modules. When one is genuinely
  not installed (a third-party package, or an mpidp module another issue is
  still building, listed in PENDING), the block is compiled and the test is
  reported as skipped, naming the module; it is never skipped silently.
- ``output`` on a ``text`` block: the preceding block's standard output.
- ``commands`` on a ``bash`` block: the README's two commands.

Every Python block must be run (or be a named set-up block that is), and
every tag must be known. The blocks of all files run in one job per launcher,
started before any test of them (outside the per-test watchdog, each job
under its own time limit). These tests start their own MPI jobs, so they run
in the serial pass only (``mpi_skip``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidp
from mpidp import launch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: every file whose blocks run: the README, then docs/
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: the README's hard size limit, in bytes (`wc -c README.md`)
README_LIMIT = 15_000
#: seconds a job may run: this much, plus as much again per block in it
BLOCK_TIMEOUT = 120

#: modules and files the docs document while another issue builds them: skipped (with this reason) until they exist
PENDING = {
    "benchmarks/bench.py": "the benchmarks are not committed yet",
}
#: modules whose public names (``__all__``) the API table must cover
API_MODULES = ("mpidp", "mpidp.torch", "mpidp.cuda", "mpidp.launch", "mpidp.checkpoint", "mpidp.lightning")
KNOWN_TAGS = {"run", "mpiexec", "torchrun", "name", "after", "requires", "output", "commands"}
LAUNCHERS = ("run", "mpiexec", "torchrun")
#: environment variables of launchers and batch systems, removed from the environment of the blocks
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "SLURM_", "MV2_", "FLUX_", "HYDRA_", "MPI_LOCAL")


@dataclasses.dataclass(frozen=True)
class Block:
    file: str  # relative to the checkout
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    tags: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def parse_blocks(text: str, file: str = "README.md") -> list[Block]:
    """Return every fenced block of ``text`` with the tags of the comment just above it."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = re.match(r"^```(\S*)\s*$", lines[i])
        if not match:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        assert i < len(lines), f"{file}:{start + 1}: unclosed code fence"
        tags: dict[str, str] = {}
        above = re.match(r"^<!-- readme-test: (.*) -->$", lines[start - 1]) if start else None
        if above:
            for item in above.group(1).split():
                key, _, value = item.partition("=")
                tags[key] = value
        blocks.append(Block(file, match.group(1), "\n".join(lines[start + 1 : i]) + "\n", start + 1, tags))
        i += 1
    return blocks


def table(path: Path) -> list[list[str]]:
    """Return the body rows of the first table of ``path``, as lists of cells."""
    rows: list[list[str]] = []
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        if not re.match(r"^\|[-| :]+\|$", line):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert len(rows) > 1, f"no table in {path.name}"
    return rows[1:]  # without the header


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


BLOCKS = [b for path in DOCS for b in parse_blocks(path.read_text(), _rel(path))]
NAMED = {(b.file, b.tags["name"]): b for b in BLOCKS if "name" in b.tags}
RUNNABLE = [b for b in BLOCKS if b.lang == "python" and any(k in b.tags for k in LAUNCHERS)]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "console", "shell")]


# ----------------------------------------------------------------- structure


def test_readme_is_short_and_leads_to_the_docs() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over its limit of {README_LIMIT}: move detail to docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", README.read_text()))
    assert {_rel(p) for p in DOCS[1:]} <= linked, f"docs not linked from README.md: {sorted({_rel(p) for p in DOCS[1:]} - linked)}"
    assert len(DOCS) >= 8


def test_every_block_is_accounted_for() -> None:
    used = {(b.file, name) for b in BLOCKS for name in b.tags.get("after", "").split(",") if name}
    for i, b in enumerate(BLOCKS):
        unknown = set(b.tags) - KNOWN_TAGS
        assert not unknown, f"{b.id}: unknown readme-test tag(s) {sorted(unknown)}"
        if b.lang == "python":
            launchers = [k for k in LAUNCHERS if k in b.tags]
            assert len(launchers) <= 1, f"{b.id}: more than one launcher {launchers}"
            if not launchers:
                assert "name" in b.tags, f"{b.id}: a Python block that nothing runs; tag it run, mpiexec=N or torchrun=N"
                assert (b.file, b.tags["name"]) in used, f"{b.id}: set-up block {b.tags['name']!r} is used by no block"
        for name in b.tags.get("after", "").split(","):
            assert not name or (b.file, name) in NAMED, f"{b.id}: after={name}: no block of {b.file} is named so"
        if "output" in b.tags:
            assert i > 0 and BLOCKS[i - 1] in RUNNABLE and BLOCKS[i - 1].file == b.file, (
                f"{b.id}: an output block must follow a block that runs"
            )
    assert len([b for b in RUNNABLE if b.file == "README.md"]) >= 2
    assert len(RUNNABLE) >= 12
    commands = [b for b in BLOCKS if "commands" in b.tags]
    assert [b.file for b in commands] == ["README.md"], "the two commands are tagged once, in the README"


def test_two_commands_and_ci() -> None:
    (block,) = [b for b in BLOCKS if "commands" in b.tags]
    commands = [line.split("#")[0].strip() for line in block.code.splitlines() if line.strip()]
    assert commands == ["scripts/demo", "scripts/test"], commands
    for command in commands:
        script = ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), f"{command} is not an executable file"
        body = script.read_text()
        assert "scripts/venv.sh" in body, f"{command} does not set up the virtual environment itself"
        assert '"$@"' in body, f"{command} does not pass its arguments on, as the README says"
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))
    ]
    assert ci == ["exec scripts/test"] or ci == ["scripts/test"], f".ci/run must run the README's test command only: {ci}"


def test_the_serial_pass_takes_its_longest_files_first() -> None:
    """conftest.LONGEST_FIRST names test files that exist, and scripts/test keeps that order (xdist's would not)."""
    from conftest import LONGEST_FIRST

    missing = [name for name in LONGEST_FIRST if not (ROOT / name).is_file()]
    assert not missing and len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), missing
    serial = [line for line in (ROOT / "scripts" / "test").read_text().splitlines() if "-n 2 --dist loadfile" in line]
    assert len(serial) == 1 and "--no-loadscope-reorder" in serial[0], serial


def test_every_collective_test_runs_at_four_ranks_with_or_without_the_hosts_pass() -> None:
    """Where the hosts pass runs, the 4-rank pass leaves it its tests: between them they run every collective test once."""
    from itertools import combinations

    from conftest import PASSES

    names = ("collective", "transport", "refusal", "hosts", "gpu")
    for n in range(len(names) + 1):
        for marks in map(set, combinations(names, n)):
            alone, beside, hosts = PASSES["ranks"](marks), PASSES["ranks-not-hosts"](marks), PASSES["hosts"](marks)
            assert alone == (beside or hosts) and not (beside and hosts), (marks, alone, beside, hosts)
            assert not hosts or alone, f"the hosts pass runs a test the 4-rank pass would not: {marks}"
    choosing = [line for line in (ROOT / "scripts" / "test").read_text().splitlines() if "ranks-not-hosts" in line]
    assert len(choosing) == 1 and 'if [ "$hosts" = 1 ] && [ "$ranks" = 4 ]; then selection=ranks-not-hosts' in choosing[0], choosing


def _paths(code: str) -> set[str]:
    return set(re.findall(r"(?<![\w/.-])((?:scripts|benchmarks|tests|mpidp|docs|\.ci)/[\w./-]*[\w])", code))


SHELL_PATHS = sorted({p for b in SHELL for p in _paths(b.code)})


def test_shell_blocks_name_the_scripts() -> None:
    assert {"scripts/slurm/train.sbatch", "scripts/gpu-check", "benchmarks/bench.py"} <= set(SHELL_PATHS), SHELL_PATHS


@pytest.mark.parametrize("path", SHELL_PATHS)
def test_paths_in_shell_blocks_exist(path: str) -> None:
    target = ROOT / path
    if not target.exists() and path in PENDING:
        pytest.skip(f"{path}: {PENDING[path]}")
    assert target.exists(), f"the docs name {path}, which does not exist"
    if path.startswith("scripts/"):
        assert os.access(target, os.X_OK), f"{path} is not executable"


def _modules(code: str) -> set[str]:
    return set(re.findall(r"-m (mpidp(?:\.\w+)*)", code))


def _spec(module: str) -> Any:
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
        return None


SHELL_MODULES = sorted({m for b in SHELL for m in _modules(b.code)} | _modules((ROOT / "scripts/slurm/train.sbatch").read_text()))


@pytest.mark.parametrize("module", SHELL_MODULES)
def test_modules_in_commands_exist(module: str) -> None:
    if _spec(module) is None:
        if module in PENDING:
            pytest.skip(f"{module}: {PENDING[module]}")
        pytest.fail(f"the docs or the sbatch template run `-m {module}`, which does not exist")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=[_rel(p) for p in DOCS])
def test_links_resolve(doc: Path) -> None:
    prose = re.sub(r"^```.*?^```$", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)  # code is no link
    links = re.findall(r"\]\(([^)\s]+)\)", prose)
    assert links or doc != README, "README.md links nowhere"
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{_rel(doc)} links to {link}, which does not exist"
        assert path.is_relative_to(ROOT), f"{_rel(doc)} links to {link}, outside the checkout"
        if anchor:
            assert path.suffix == ".md" and anchor in _anchors(path), f"{_rel(doc)} links to {link}, which is no heading"


# --------------------------------------------------------- running the blocks


def _clean_env() -> dict[str, str]:
    """The environment of the blocks: no launcher variables; mpidp comes from its installation, not from a path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    if "Open MPI" in MPI.Get_library_version():  # what docs/install.md says Open MPI needs
        env.update(
            PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        )
    return env


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec next to this python or on PATH")
    return found


def _run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = BLOCK_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group; after ``timeout`` seconds the whole group is killed."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env or _clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed: did not finish in {timeout} s]"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _source(block: Block) -> str:
    parts = [NAMED[block.file, n].code for n in block.tags.get("after", "").split(",") if n]
    return "\n".join([*parts, block.code])


def _missing(block: Block) -> str | None:
    """Return why a module the block requires is unavailable, or None; fail for a misspelt mpidp module."""
    needs = [m for m in block.tags.get("requires", "").split(",") if m]
    if "torchrun" in block.tags:
        needs.append("torch.distributed.run")
    for module in needs:
        if _spec(module) is not None:
            continue
        if module.split(".")[0] == "mpidp" and module not in PENDING:
            pytest.fail(f"{block.id} requires {module}, which is no mpidp module")
        return PENDING.get(module, f"{module} is not installed")
    return None


def _expected_output(block: Block) -> str | None:
    i = BLOCKS.index(block)
    if i + 1 < len(BLOCKS) and "output" in BLOCKS[i + 1].tags and BLOCKS[i + 1].file == block.file:
        return BLOCKS[i + 1].code
    return None


def _launch(block: Block) -> tuple[str, str]:
    return next((k, block.tags[k]) for k in LAUNCHERS if k in block.tags)


#: Runs each block as ``__main__`` in turn, in one job per launcher, so that every process imports
#: torch and starts MPI once; records each block's output and error per process; a failing block
#: re-raises, which ends the job (``python -m mpi4py`` aborts it, torchrun tears it down).
DRIVER = """\
import contextlib, io, json, os, runpy, sys, traceback
for path in sys.argv[1:]:
    out, error = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except BaseException:
        error = traceback.format_exc()
    with open(f"{path}.{os.getpid()}.json", "w") as f:
        json.dump({"stdout": out.getvalue(), "error": error}, f)
    if error is not None:
        sys.stderr.write(error)
        raise SystemExit(f"{path} failed")
"""


@dataclasses.dataclass
class Job:
    result: subprocess.CompletedProcess[str]
    scripts: dict[str, Path]  # block id -> snippet file


def _start(key: tuple[str, str], workdir: Path) -> Job:
    """Run every runnable block of launcher ``key`` in one job."""
    driver = workdir / "driver.py"
    driver.write_text(DRIVER)
    scripts = {}
    for b in RUNNABLE:
        if _launch(b) == key and _missing(b) is None:
            scripts[b.id] = workdir / f"{Path(b.file).stem}_line{b.line}.py"
            scripts[b.id].write_text(_source(b))
    files = [str(p) for p in scripts.values()]
    if key[0] == "mpiexec":
        argv = [_mpiexec(), "-n", key[1], sys.executable, "-m", "mpi4py", str(driver), *files]
    elif key[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={key[1]}", str(driver), *files]
    else:
        argv = [sys.executable, str(driver), *files]
    return Job(_run(argv, workdir, timeout=BLOCK_TIMEOUT * (1 + len(files))), scripts)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Job]:
    """Every launcher's finished job, run here: a module fixture is set up before the per-test watchdog starts."""
    keys = sorted({_launch(b) for b in RUNNABLE if _missing(b) is None})
    return {key: _start(key, tmp_path_factory.mktemp(f"{key[0]}{key[1]}")) for key in keys}


@pytest.mark.mpi_skip
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_python_block(block: Block, jobs: dict[tuple[str, str], Job]) -> None:
    compile(_source(block), block.id, "exec")
    why = _missing(block)
    if why is not None:
        pytest.skip(f"{block.id}: {why}; compiled, not run")
    job = jobs[_launch(block)]
    script = job.scripts[block.id]
    results = [json.loads(p.read_text()) for p in sorted(script.parent.glob(f"{script.name}.*.json"))]
    context = f"\njob: {' '.join(job.result.args)} -> {job.result.returncode}\nstdout:\n{job.result.stdout}\nstderr:\n{job.result.stderr}"
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, f"{block.id} failed:\n{errors[0]}{context}"
    ranks = int(_launch(block)[1] or 1)
    assert len(results) == ranks, f"{block.id} did not finish on every process ({len(results)} of {ranks}){context}"
    expected = _expected_output(block)
    if expected is not None:
        got = [line.rstrip() for r in results for line in r["stdout"].strip().splitlines()]
        assert got == expected.strip().splitlines(), f"{block.id} printed\n{got}\nthe docs show\n{expected}"


# -------------------------------------------------------------------- tables


ENVIRONMENT = ROOT / "docs" / "environment.md"
API = ROOT / "docs" / "api.md"


def _table_variables() -> dict[str, list[str]]:
    """Every variable of the environment table -> its row."""
    out = {}
    for row in table(ENVIRONMENT):
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row[0]):
            out[name] = row
    return out


def _sources() -> list[Path]:
    files = [p for d in ("mpidp", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
    files += [p for p in (ROOT / "scripts").rglob("*") if p.is_file()]
    files += [p for p in (ROOT / ".ci").rglob("*") if p.is_file()]
    return [p for p in files if p.resolve() != Path(__file__).resolve() and "__pycache__" not in p.parts]


def _read_variables() -> dict[str, set[Path]]:
    """Every MPIDP_* variable the project reads -> the files that read it."""
    found: dict[str, set[Path]] = {}
    for path in _sources():
        text = path.read_text(errors="replace")
        pattern = r"[\"'](MPIDP_[A-Z0-9_]+)[\"']" if path.suffix == ".py" else r"\$\{?(MPIDP_[A-Z0-9_]+)"
        for name in re.findall(pattern, text):
            found.setdefault(name, set()).add(path)
    return found


def test_environment_table_matches_the_code() -> None:
    documented = _table_variables()
    read = _read_variables()
    assert "MPIDP_TIMEOUT" in read
    undocumented = sorted(set(read) - set(documented))
    assert not undocumented, f"read by the code but missing from docs/environment.md: {undocumented}"
    unread = sorted(v for v in documented if v.startswith("MPIDP_") and v not in read)
    assert not unread, f"in docs/environment.md but read nowhere: {unread}"
    checked = set(launch.MPI_SIZE_VARIABLES + launch.SCHEDULER_SIZE_VARIABLES)
    assert checked <= set(documented), f"the launch check reads {sorted(checked - set(documented))}, undocumented"


def test_environment_table_defaults_match_the_code() -> None:
    compared = 0
    for name, row in _table_variables().items():
        default = re.fullmatch(r"`([^`]+)`", row[2])
        if default is None:
            continue
        for path in _sources():
            text = path.read_text(errors="replace")
            for value in re.findall(rf"\$\{{{name}:-([^}}]*)\}}", text) + re.findall(rf"[\"']{name}[\"'],\s*[\"']([^\"']*)[\"']", text):
                if "$" not in value:
                    assert value == default.group(1), f"{name}: docs/environment.md says default {default.group(1)}, {path.name} uses {value}"
                    compared += 1
    assert compared >= 4


def _api_rows() -> list[tuple[str, str, str]]:
    rows = []
    for cells in table(API):
        shown = re.match(r"`([\w.]+)", cells[0])
        assert shown, f"API table row without a name: {cells[0]}"
        rows.append((shown.group(1), cells[1], cells[0]))
    return rows


API_ROWS = _api_rows()


def _resolve(dotted: str) -> Any:
    """Import the longest module prefix of ``dotted`` and get the rest as attributes (or dataclass fields)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        if _spec(module_name) is None:
            continue
        obj: Any = importlib.import_module(module_name)
        for name in parts[cut:]:
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
                obj = next(f for f in dataclasses.fields(obj) if f.name == name)
            else:
                obj = inspect.getattr_static(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def _pending(dotted: str) -> str | None:
    for module, why in PENDING.items():
        if (dotted == module or dotted.startswith(module + ".")) and _spec(module) is None:
            return why
    return None


def _says(obj: Any) -> str | None:
    """Return "collective", "local" or None: what the docstring says."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    doc = obj.__doc__ if isinstance(obj, property) else inspect.getdoc(obj)
    if not doc or isinstance(obj, enum.Enum):  # a member shows its class's docstring
        return None
    if re.search(r"\bcollective\b", doc, re.IGNORECASE) and not re.search(r"\bnot collective\b", doc, re.IGNORECASE):
        return "collective"
    if re.search(r"(^|[(\s])local[;:,)]|no communication", doc, re.IGNORECASE):
        return "local"
    return None


@pytest.mark.parametrize(("name", "collective", "cell"), API_ROWS, ids=[r[0] for r in API_ROWS])
def test_api_table_entry_exists(name: str, collective: str, cell: str) -> None:
    why = _pending(name)
    if why is not None:
        pytest.skip(f"{name}: {why}")
    obj = _resolve(name)
    assert re.match(r"^(yes|no)\b", collective), f"{name}: the Collective column says {collective!r}"
    says = _says(obj)
    if says == "collective":
        assert collective.startswith("yes"), f"{name}: the docstring says collective, docs/api.md says {collective!r}"
    if says == "local":
        assert collective.startswith("no"), f"{name}: the docstring says local, docs/api.md says {collective!r}"
    signature = re.match(r"`[\w.]+\(([^`]*)\)`", cell)
    target = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    if signature is not None and callable(target) and not isinstance(target, type):
        documented = [p.split("=")[0].strip(" *") for p in signature.group(1).split(",") if p.strip(" *")]
        actual = [p for p in inspect.signature(target).parameters if p not in ("self", "cls")]
        assert documented == actual, f"{name}: docs/api.md shows parameters {documented}, the code has {actual}"


def _public_names(module_name: str) -> set[str]:
    module = importlib.import_module(module_name)
    names = set()
    for name in module.__all__:
        names.add(f"{module_name}.{name}")
        obj = getattr(module, name)
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            members = {n for n in vars(obj) if not n.startswith("_")}
            if dataclasses.is_dataclass(obj):
                members |= {f.name for f in dataclasses.fields(obj)}
            names |= {f"{module_name}.{name}.{m}" for m in members}
    return names


@pytest.mark.parametrize("module", API_MODULES)
def test_api_table_covers_every_public_name(module: str) -> None:
    if _spec(module) is None:
        if module in PENDING:
            pytest.skip(f"{module}: {PENDING[module]}")
        pytest.fail(f"{module} does not exist")
    documented = {name for name, _, _ in API_ROWS}
    documented |= {name.rsplit(".", 1)[0] for name in documented}  # a class is shown by its members
    missing = sorted(_public_names(module) - documented)
    assert not missing, f"public names missing from docs/api.md: {missing}"


# ------------------------------------------------------------- sbatch template

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def test_sbatch_template_is_well_formed() -> None:
    assert os.access(SBATCH, os.X_OK)
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    lines = SBATCH.read_text().splitlines()
    assert lines[0].startswith("#!")
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [line for line in lines if line.startswith(("#SBATCH", "##SBATCH"))]  # '##': disabled, documented
    assert all(lines.index(d) < first_command for d in directives), "sbatch ignores #SBATCH lines after the first command"
    for option in ("--nodes=", "--ntasks-per-node=", "--cpus-per-task=", "--time=", "--gpus-per-task="):
        assert any(d.split()[1].startswith(option) for d in directives), f"the template does not show {option}"


#: what a stand-in python prints for ``python -m mpi4py --mpi-lib-version`` as Open MPI does: a NUL byte, two lines
OPEN_MPI_VERSION = "Open MPI v5.0.8, package: Open MPI builder Distribution, ident: 5.0.8, repo rev: v5.0.8\\0\\nMPI 4.1\\n"


@pytest.mark.mpi_skip
@pytest.mark.parametrize(("override", "library"), [(None, None), ("pmix", None), (None, "Open MPI")])
def test_sbatch_template_launches_the_example(tmp_path: Path, override: str | None, library: str | None) -> None:
    """Run the template with a recording ``srun`` and a stand-in environment holding this python.

    With ``library="Open MPI"`` the stand-in python reports Open MPI's version string (NUL byte included): the
    template must pick pmix, set PMIX_MCA_psec, and print the version's first line without a bash warning.
    """
    bin_dir = tmp_path / "bin"
    venv = tmp_path / "venv"
    bin_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    fake = f'if [ "$*" = "-m mpi4py --mpi-lib-version" ]; then printf "{OPEN_MPI_VERSION}"; exit 0; fi\n' if library else ""
    (venv / "bin" / "python").write_text(f'#!/bin/sh\n{fake}exec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    log = tmp_path / "srun.log"
    srun = bin_dir / "srun"
    srun.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}"\n'
        f'echo "MPIDP_TIMEOUT=$MPIDP_TIMEOUT OMP_NUM_THREADS=$OMP_NUM_THREADS PMIX_MCA_psec=$PMIX_MCA_psec" >> "{log}"\n'
    )
    srun.chmod(0o755)
    env = _clean_env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", MPIDP_VENV=str(venv), SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="8", SLURM_CPUS_PER_TASK="8",
        PYTHONUNBUFFERED="1",  # inherited from a login shell, it made `... --mpi-lib-version | head -n 1` raise BrokenPipeError
    )
    env.pop("MPIDP_TIMEOUT", None)
    env.pop("PMIX_MCA_psec", None)
    if override:
        env["MPIDP_SRUN_MPI"] = override
    result = _run(["bash", str(SBATCH), "--steps", "3"], tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # no BrokenPipeError, no "ignored null byte in input"
    version = OPEN_MPI_VERSION.split("\\0")[0] if library else MPI.Get_library_version().replace("\0", "").splitlines()[0]
    expected = override or ("pmix" if "Open MPI" in (library or MPI.Get_library_version()) else "pmi2")
    assert log.read_text().splitlines() == [
        f"--mpi={expected}", "--cpus-per-task=8", "python", "-m", "mpi4py", "-m", "mpidp.examples.charlm",
        "--save", str(ROOT / "checkpoints" / "mpidp"), "--steps", "3",
        f"MPIDP_TIMEOUT= OMP_NUM_THREADS=8 PMIX_MCA_psec={'native' if expected == 'pmix' else ''}",
    ]
    assert result.stdout.splitlines() == [f"mpidp: 2 node(s), 8 rank(s), srun --mpi={expected}, {version.strip()}"]


def test_sbatch_template_shows_a_one_node_submission() -> None:
    """The 2-node default stays PENDING forever on a small cluster: the header shows how to ask for one node."""
    header = SBATCH.read_text().split("set -euo pipefail")[0]
    assert re.search(r"^#\s+sbatch -N1 --ntasks-per-node=\d+ --cpus-per-task=\d+ scripts/slurm/train.sbatch", header, re.MULTILINE)
    assert "137" in header and "PENDING" in header


def test_version_is_defined_once_where_the_readme_says() -> None:
    assert re.search(r'^__version__ = "[^"]+"$', (ROOT / "mpidp" / "__init__.py").read_text(), re.MULTILINE)
    assert "version = attr: mpidp.__version__" in (ROOT / "setup.cfg").read_text()
    assert mpidp.__version__


# ------------------------------------------------------------- promises the docs keep

GUIDE, MIGRATION, PERFORMANCE, GPU = (ROOT / "docs" / f"{n}.md" for n in ("guide", "migration", "performance", "gpu"))
#: what a newcomer reads about the library: the README and docs/, but for the performance page's lab notes
PROSE = [p for p in DOCS if p != PERFORMANCE]


def _prose(path: Path) -> str:
    return re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def _paragraphs(path: Path) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", _prose(path))]


def _performance_overlap_figure() -> set[int]:
    """The percentages of the reduction left after backward for the ResNet-50-sized model with the thread and the weight."""
    header: list[str] = []
    left: set[int] = set()
    for line in PERFORMANCE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "left vs plain" in cells:
            header = cells
        elif header and len(cells) == len(header) and "resnet-25m" in cells[0] and cells[1] == "mpidp_thread_weight":
            left.add(round(100 * float(cells[header.index("left vs plain")].rstrip("x"))))
    return left


def test_the_overlap_figure_is_one_figure_the_performance_page_holds() -> None:
    """README and guide give the same share of the reduction left after backward, and cite where it was measured."""
    readme = re.search(r"(\d+)-(\d+)% of a ResNet-50-sized model's reduction is left after backward", " ".join(_paragraphs(README)))
    guide = re.search(r"ResNet-50-sized stand-in of \[performance: Overlap with backward\][^)]*\), \d+-\d+% of the reduction is left after "
                      r"backward without it, (\d+)-(\d+)% with it", " ".join(_paragraphs(GUIDE)))
    assert readme and guide, (readme, guide)
    assert readme.groups() == guide.groups(), (readme.groups(), guide.groups())
    low, high = map(int, readme.groups())
    measured = _performance_overlap_figure()
    if measured:  # the table as it stands: every figure the README gives, and no other
        assert {low, high} == {min(measured), max(measured)}, (readme.groups(), measured)
    else:  # a rewritten page states the figure in words
        assert f"{low}-{high}%" in PERFORMANCE.read_text(), f"docs/performance.md does not state {low}-{high}%"
    assert "## Overlap with backward" in PERFORMANCE.read_text()
    for path in (README, GUIDE):
        assert "performance.md#overlap-with-backward" in path.read_text(), path.name


def test_overlap_is_not_promised_bit_for_bit_where_it_is_not() -> None:
    """Where the plain path reduce-scatters float32 (262,144 values or more at 3 or more ranks) the last bits can differ."""
    for path in PROSE:
        for paragraph in _paragraphs(path):
            if "bit for bit" in paragraph and ("overlap" in paragraph or "plain path" in paragraph):
                assert "262,144" in paragraph and "3 or more ranks" in paragraph, f"{_rel(path)}: {paragraph[:200]}"
    docstring = inspect.getdoc(importlib.import_module("mpidp.torch").DataParallel) or ""
    assert "bit for bit" not in docstring or "262,144" in docstring


def test_the_adapter_is_never_called_a_wrapper() -> None:
    """It is built next to the model (``dp.module`` is the model itself), never around it."""
    for path in PROSE:
        text = _prose(path)
        for match in re.finditer(r"\bwrap\w*", text, re.IGNORECASE):
            before = text[max(0, match.start() - 25) : match.start()].lower()
            assert re.search(r"\bnot\b|not-a-|nothing", before), f"{_rel(path)}: ...{text[match.start() - 60 : match.end() + 40]}..."
    assert any(name == "mpidp.torch.DataParallel.module" for name, _, _ in API_ROWS)


def test_the_readme_says_which_numpy_dtypes_and_that_numpy_s_default_is_refused() -> None:
    opening = _paragraphs(README)[1]
    assert "float32, float16 or bfloat16" in opening and "float64" in opening and "refused" in opening, opening
    with pytest.raises(mpidp.ContractError, match="float64"):
        mpidp.DataParallel.initialize({"w": np.zeros(3)}, MPI.COMM_SELF)


def test_the_readme_says_how_long_the_test_command_takes() -> None:
    assert re.search(r"`scripts/test` takes about \d+ minutes on a \d+-core machine", " ".join(_paragraphs(README)))


def test_the_gpu_page_says_the_gpu_paths_ran_on_the_stand_in_only() -> None:
    """Until a run on a real GPU is recorded on the page (a section of its own), it says so plainly, first."""
    text = GPU.read_text()
    if "## Runs on real GPUs" in text:
        return
    first = _paragraphs(GPU)[1]
    assert first.startswith("**Not yet run on a real GPU.**") and "only on the CPU stand-in" in first, first


def test_mixed_precision_recipes_reduce_before_unscaling_and_clipping() -> None:
    """The guide and the porting page each run a GradScaler loop: reduce, then unscale_, then clip, then step."""
    for path in (GUIDE, MIGRATION):
        loops = [b for b in RUNNABLE if b.file == _rel(path) and "GradScaler" in b.code]
        assert loops, f"{_rel(path)} runs no GradScaler loop"
        for b in loops:
            order = [b.code.index(call) for call in ("dp.reduce(", "scaler.unscale_(", "clip_grad_norm_(", "scaler.step(")]
            assert order == sorted(order), f"{b.id}: reduce, unscale_, clip_grad_norm_, step must come in that order"
    assert "autocast" in GUIDE.read_text() and "bfloat16" in GUIDE.read_text()
