"""mpidp: replicated data parallelism over MPI with exact global token means.

``import mpidp`` imports neither torch nor cupy; ``import mpidp.torch`` does.
"""

from .core import DataParallel, MissingGradientPolicy, ReducedGradients, flat_parameters
from .errors import CollectiveError, ContractError, DataParallelError
from .exact import shard

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "ContractError",
    "DataParallel",
    "DataParallelError",
    "MissingGradientPolicy",
    "ReducedGradients",
    "__version__",
    "flat_parameters",
    "shard",
]
