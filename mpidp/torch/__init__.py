"""The PyTorch adapter: an ``nn.Module`` as named arrays, its hooks and overlapped windows (imports torch).

``mpidp.torch.DataParallel`` is :class:`mpidp.torch.adapter.DataParallel`;
what it reads of a model is in :mod:`mpidp.torch.model`, its autograd hooks
in :mod:`mpidp.torch.overlap`.
"""

from .adapter import DataParallel

__all__ = ["DataParallel"]
