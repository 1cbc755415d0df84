"""Runnable examples: ``mpiexec -n 4 python -m mpi4py -m mpidp.examples.<name>``."""
