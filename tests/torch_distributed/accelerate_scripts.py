"""Accelerate's shipped ``test_ops`` and ``test_sync``, unmodified, then trainer_script.py, in one job (test_clients.py runs it).

``test_ops.main`` makes a bare ``PartialState()``, which reads no
``ACCELERATE_USE_CPU`` (``Accelerator()`` does): on a host without a GPU it
would run each rank alone, under torchrun too. So the state is made first
with ``cpu=True``, as ``Accelerator()`` makes it there. Each script destroys
the default process group at its end: it is made again (over "mpidp")
before the next. One job for the three: Transformers and Accelerate are
imported once.
"""

import torch.distributed as dist
import trainer_script
from accelerate import PartialState
from accelerate.test_utils.scripts import test_ops, test_sync

if __name__ == "__main__":
    PartialState(cpu=True)
    test_ops.main()
    dist.init_process_group("mpidp")
    test_sync.main()
    dist.init_process_group("mpidp")
    trainer_script.main()
