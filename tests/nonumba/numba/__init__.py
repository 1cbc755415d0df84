"""A stand-in that hides numba (scripts/test puts this folder first on PYTHONPATH): a process as the README installs it."""

raise ModuleNotFoundError("numba is hidden by tests/nonumba (scripts/test's run without numba)")
