"""A stand-in that hides numba (scripts/test puts this folder first on PYTHONPATH): a process with torch but without numba (a platform without numba's wheels, or torch installed without mpidp's extra)."""

raise ModuleNotFoundError("numba is hidden by tests/nonumba (scripts/test's run without numba)")
