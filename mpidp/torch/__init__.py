"""The PyTorch adapter: an ``nn.Module`` as named arrays, its hooks and overlapped windows (imports torch).

``mpidp.torch.DataParallel`` is :class:`mpidp.torch.adapter.DataParallel`;
what it reads of a model is in :mod:`mpidp.torch.model`, its autograd hooks
in :mod:`mpidp.torch.overlap`; its sharded optimizers in :mod:`mpidp.torch.optim`.
"""

from .adapter import DataParallel
from .optim import ShardedAdam, ShardedAdamW, ShardedSGD

__all__ = ["DataParallel", "ShardedAdam", "ShardedAdamW", "ShardedSGD"]
