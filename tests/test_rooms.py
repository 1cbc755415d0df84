"""The house: which module may speak MPI, and imports run downward only (read from the sources, no MPI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpidp"
#: every module's floor: a module imports only modules on lower floors
FLOORS = {
    "errors": 0,
    "arrays": 1, "launch": 1, "kernels": 1, "buckets": 1,
    "contract": 2, "packing": 2, "comm": 2,
    "layout": 3, "records": 3, "cuda": 3, "guard": 3, "progress": 3,
    "window": 4, "checks": 4,
    "core": 5,
    "overlapped": 6,
    "torch_overlap": 7,
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
    assert inside <= {"arrays", "core", "checks", "contract", "packing", "torch_overlap"}, inside
    assert imports("torch_overlap")[1] <= {"overlapped"}  # the owner only (it reaches autograd's engine as DDP does: private to torch)
    private = [
        ast.unparse(node)
        for node in ast.walk(ast.parse((PACKAGE / "torch.py").read_text()))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self") and node.attr != "_replace"
    ]
    assert not private, f"reaches into other objects' private names: {private}"
