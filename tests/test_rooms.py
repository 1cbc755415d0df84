"""The house: which module may speak MPI, and imports run downward only (read from the sources, no MPI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpidp"
#: every module's floor: a module imports only modules on lower floors
FLOORS = {
    "errors": 0, "arrays": 0, "kernels": 0,
    "launch": 1, "casts": 1, "exact_kernels": 1, "exact_torch": 1,
    "contract": 2, "packing": 2, "comm": 2, "exact": 2, "buckets": 2,
    "layout": 3, "records": 3, "guard": 3, "progress": 3,
    "cuda": 3.5,  # the device room stands on the agreement it uses (select_device's), under checks and window
    "exact_window": 4, "exact_buckets": 4,
    "window": 4, "checks": 4,
    "session": 4.5,
    "core": 5,
    "overlapped": 6,
    "torch_overlap": 7, "torch_model": 7,
    "torch": 8,
    "__init__": 9,
}


def imports(name: str) -> tuple[set[str], set[str]]:
    """(top-level packages, mpidp modules) that module ``name`` imports, at run time or for type checking."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    outside, inside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            outside |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                outside.add((node.module or "").split(".")[0])
            elif node.module:
                inside.add(node.module.split(".")[0])
            else:
                inside |= {a.name for a in node.names}
    return outside, inside


def test_every_module_has_a_floor() -> None:
    assert sorted(p.stem for p in PACKAGE.glob("*.py")) == sorted(FLOORS)


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_imports_run_downward_only(name: str) -> None:
    _, inside = imports(name)
    upward = sorted(m for m in inside if FLOORS[m] >= FLOORS[name])
    assert not upward, f"mpidp.{name} (floor {FLOORS[name]}) imports {upward}"


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_only_comm_and_the_device_room_speak_mpi(name: str) -> None:
    outside, _ = imports(name)
    assert ("mpi4py" in outside) == (name in ("comm", "cuda")), name


def test_comm_knows_no_device_framework() -> None:
    outside, _ = imports("comm")
    assert not outside & {"torch", "cupy"}
    assert "cupy" not in (PACKAGE / "comm.py").read_text() and "torch" not in (PACKAGE / "comm.py").read_text()


def test_the_torch_adapter_only_translates() -> None:
    _, inside = imports("torch")
    # no comm, guard or records of its own; its overlapped path is a room of the adapter
    assert inside <= {"arrays", "core", "checks", "contract", "packing", "torch_model", "torch_overlap"}, inside
    assert imports("torch_overlap")[1] <= {"overlapped"}  # the owner only (it reaches autograd's engine as DDP does: private to torch)
    private = [
        ast.unparse(node)
        for node in ast.walk(ast.parse((PACKAGE / "torch.py").read_text()))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self") and node.attr != "_replace"
    ]
    assert not private, f"reaches into other objects' private names: {private}"


# ------------------------------------------------------------------ limits (issue 31)

#: the overlapped window's rooms: their limits hold without exception
OVERLAP_WING = ("buckets", "progress", "overlapped", "torch_overlap")


def functions(name: str) -> list[tuple[str, int]]:
    """(name, lines) of every function of module ``name``, docstring included."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    return [
        (node.name, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
        for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_rooms_hold_500_lines_and_functions_50(name: str) -> None:
    lines = len((PACKAGE / f"{name}.py").read_text().splitlines())
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

    visit(ast.parse((PACKAGE / f"{name}.py").read_text()), "")
    return out


#: where the mode is read from the user or chosen, once: validating ``overlap=`` and the owner's creation
CHOOSING = {("torch", "_overlap_problem"), ("overlapped", "_choose")}


@pytest.mark.parametrize("name", ["buckets", "core", "overlapped", "torch", "torch_overlap"])  # every room overlap reaches
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


@pytest.mark.parametrize("name", sorted(set(FLOORS) - {"buckets", "overlapped"}))
def test_the_bucket_state_is_used_by_its_owner_only(name: str) -> None:
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "buckets" for a in node.names}
    assert "Buckets" not in imported, f"mpidp.{name} imports the bucket state"
    reached = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in ("_state", "_engine")]
    assert not reached, f"mpidp.{name} reaches into the owner's bucket state or engine: {reached}"
