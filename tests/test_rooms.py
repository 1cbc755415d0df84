"""The house: which module may speak MPI, and imports run downward only, between rooms and between packages (read from the sources, no MPI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpidp"
#: every module's floor: a module imports only modules on lower floors. A package's ``__init__`` goes by
#: the package's name (``exact``), a room in a package by its dotted name (``exact.sums``); the examples are users.
FLOORS = {
    "errors": 0, "arrays": 0, "kernels": 0, "overlap": 0,
    "launch": 1, "cut": 1, "casts": 1, "exact.compiled": 1, "exact.torch_passes": 1, "exact.numpy_passes": 1, "optim.rules": 1, "optim.state": 1, "optim.norm": 1, "optim.groups": 1,
    "contract": 2, "packing": 2, "comm": 2, "exact.sums": 2, "overlap.buckets": 2,
    "exact": 2.5,
    "layout": 3, "records": 3, "guard": 3, "overlap.progress": 3, "optim.moves": 3,
    "cuda": 3.5,  # the device room stands on the agreement it uses (select_device's), under checks and window
    "exact.window": 4, "overlap.exact_jobs": 4, "optim.offload": 4,
    "window": 4, "checks": 4,
    "session": 4.5,
    "core": 5,
    "overlap.owner": 6, "optim.sharded": 6,
    "optim.optimizers": 6.5,
    "optim": 6.8,
    "checkpoint.files": 1.5, "checkpoint.collective": 4, "checkpoint.stop": 4.5, "checkpoint.state": 4.5,
    "checkpoint": 5, "checkpoint.__main__": 5,
    "torch.overlap": 7, "torch.model": 7, "torch.checkpoint": 7, "torch.scaling": 7,
    "torch.collectives": 7, "torch.distributed": 7.5, "torch.run": 7.8,
    "torch.adapter": 8,
    "torch.optim": 8.2,
    "torch": 8.5,
    "lightning.collectives": 8.6, "lightning.checkpoints": 8.6, "lightning.window": 8.7,
    "lightning.trainer": 8.8, "lightning.fabric": 8.8,
    "lightning": 8.9,
    "__init__": 9,
}
#: the wings (packages) above the core's rooms, lowest first: a wing imports the core and the wings below it only,
#: and the core's rooms import no wing but the exact sums (``exact``: the arithmetic of ``exact=True`` sessions)
WINGS = ("exact", "overlap", "optim", "checkpoint", "torch", "lightning")


def path(name: str) -> Path:
    """The source file of module ``name`` (``core``, ``exact``, ``exact.sums``)."""
    parts = name.split(".")
    if (PACKAGE / parts[0]).is_dir():
        return PACKAGE.joinpath(*parts[:-1], f"{parts[-1]}.py") if len(parts) > 1 else PACKAGE / name / "__init__.py"
    return PACKAGE / f"{name}.py"


def wing(name: str) -> str:
    """The package that module ``name`` belongs to ("" for the core's rooms at the top)."""
    first = name.split(".")[0]
    return first if first in WINGS else ""


def imports(name: str) -> tuple[set[str], set[str]]:
    """(top-level packages, mpidp modules) that module ``name`` imports, at run time or for type checking."""
    tree = ast.parse(path(name).read_text())
    here = name.split(".")[:-1] if "." in name else ([name] if name in WINGS else [])
    outside, inside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            outside |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                outside.add((node.module or "").split(".")[0])
                continue
            base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            for a in node.names:
                room = ".".join([*base, a.name])
                inside.add(room if room in FLOORS else ".".join(base))
    return outside, inside


def test_every_module_has_a_floor() -> None:
    found = {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__") or "__init__"
        for p in PACKAGE.rglob("*.py") if "examples" not in p.relative_to(PACKAGE).parts
    }
    assert sorted(found) == sorted(FLOORS)


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_imports_run_downward_only(name: str) -> None:
    _, inside = imports(name)
    upward = sorted(m for m in inside if FLOORS[m] >= FLOORS[name])
    assert not upward, f"mpidp.{name} (floor {FLOORS[name]}) imports {upward}"


@pytest.mark.parametrize("name", sorted(set(FLOORS) - {"__init__"}))
def test_wings_import_the_core_and_lower_wings_only(name: str) -> None:
    _, inside = imports(name)
    mine = wing(name)
    allowed = set(WINGS[: WINGS.index(mine) + 1]) if mine else {"exact"}
    above = sorted(m for m in inside if wing(m) and wing(m) not in allowed)
    assert not above, f"mpidp.{name} ({mine or 'core'}) imports a wing above it: {above}"


@pytest.mark.parametrize("name", WINGS)
def test_every_package_says_what_it_holds(name: str) -> None:
    doc = ast.get_docstring(ast.parse(path(name).read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"mpidp/{name}/__init__.py needs a one-line docstring"


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_only_comm_and_the_device_room_speak_mpi(name: str) -> None:
    outside, _ = imports(name)
    assert ("mpi4py" in outside) == (name in ("comm", "cuda")), name


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_only_the_torch_package_imports_torch(name: str) -> None:
    # the device room's select_device also makes PyTorch's device current, whether or not torch is imported yet;
    # elsewhere a torch array handed in is reached through sys.modules; the Lightning wing stands over the torch one
    outside, _ = imports(name)
    assert "torch" not in outside or wing(name) in ("torch", "lightning") or name == "cuda", f"mpidp.{name} imports torch"


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_only_the_lightning_package_imports_lightning(name: str) -> None:
    # the Lightning integration stands over the torch adapter (mpidp.lightning): nothing below it needs Lightning
    outside, _ = imports(name)
    assert not outside & {"lightning", "lightning_utilities", "pytorch_lightning"} or wing(name) == "lightning", f"mpidp.{name} imports Lightning"


def test_comm_knows_no_device_framework() -> None:
    outside, _ = imports("comm")
    assert not outside & {"torch", "cupy"}
    assert "cupy" not in path("comm").read_text() and "torch" not in path("comm").read_text()


def test_the_torch_adapter_only_translates() -> None:
    _, inside = imports("torch.adapter")
    # no comm, guard or records of its own; its overlapped path is a room of the adapter
    assert inside <= {"arrays", "core", "checks", "contract", "packing", "torch.checkpoint", "torch.model", "torch.overlap"}, inside
    assert imports("torch.overlap")[1] <= {"overlap.owner"}  # the owner only (it reaches autograd's engine as DDP does: private to torch)
    private = [
        ast.unparse(node)
        for node in ast.walk(ast.parse(path("torch.adapter").read_text()))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self") and node.attr != "_replace"
    ]
    assert not private, f"reaches into other objects' private names: {private}"


# ------------------------------------------------------------------ limits (issue 31)

#: the overlapped window's rooms: their limits hold without exception
OVERLAP_WING = ("overlap.buckets", "overlap.progress", "overlap.owner", "torch.overlap")


def functions(name: str) -> list[tuple[str, int]]:
    """(name, lines) of every function of module ``name``, docstring included."""
    tree = ast.parse(path(name).read_text())
    return [
        (node.name, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
        for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_rooms_hold_500_lines_and_functions_50(name: str) -> None:
    lines = len(path(name).read_text().splitlines())
    assert lines <= 500, f"mpidp.{name}: {lines} lines"
    long = [(f, n) for f, n in functions(name) if n > 50]
    assert not long, f"mpidp.{name}: functions over 50 lines: {long}"


def conditions(name: str) -> list[tuple[str, ast.expr]]:
    """(enclosing function, test) of every branch in module ``name``: if, while, conditional expressions, boolean operands."""
    out: list[tuple[str, ast.expr]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else where
            if isinstance(child, (ast.If, ast.While, ast.IfExp)):
                out.append((where, child.test))
            elif isinstance(child, ast.BoolOp):
                out.extend((where, v) for v in child.values)
            visit(child, inner)

    visit(ast.parse(path(name).read_text()), "")
    return out


#: where the mode is read from the user or chosen, once: validating ``overlap=`` and the owner's creation
CHOOSING = {("torch.adapter", "_overlap_problem"), ("overlap.owner", "_choose")}


@pytest.mark.parametrize("name", ["overlap.buckets", "core", "overlap.owner", "torch.adapter", "torch.overlap"])  # every room overlap reaches
def test_no_branch_on_the_overlap_mode_outside_the_progress_engines(name: str) -> None:
    branches = []
    for where, test in conditions(name):
        if (name, where) in CHOOSING:
            continue
        for node in ast.walk(test):
            by_attribute = isinstance(node, ast.Attribute) and node.attr in ("mode", "threaded")
            by_name = isinstance(node, ast.Constant) and node.value in ("thread", "hooks")
            by_type = isinstance(node, ast.Name) and node.id in ("NonBlocking", "CommThread")
            if by_attribute or by_name or by_type:
                branches.append(f"{where}: {ast.unparse(test)}")
    assert not branches, f"mpidp.{name} branches on the overlap mode: {branches}"


@pytest.mark.parametrize("name", sorted(set(FLOORS) - {"overlap.buckets", "overlap.owner"}))
def test_the_bucket_state_is_used_by_its_owner_only(name: str) -> None:
    tree = ast.parse(path(name).read_text())
    imported = {
        a.name for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "buckets" for a in node.names
    }
    assert "Buckets" not in imported, f"mpidp.{name} imports the bucket state"
    reached = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in ("_state", "_engine")]
    assert not reached, f"mpidp.{name} reaches into the owner's bucket state or engine: {reached}"
