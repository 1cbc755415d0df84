"""One job of real clients under ``mpiexec -n 2 python -m mpidp.torch.run --report -m clients_job --flag x`` (test_clients.py).

In turn: torchrun_script.py (a script written for torchrun), Accelerate's
shipped ``test_ops`` and ``test_sync`` (unmodified), and a tiny Hugging
Face ``Trainer`` run (trainer_script.py). One job, so that torch,
Transformers and Accelerate are imported once. Each of them destroys the
default process group at its end; it is made again (over "mpidp") before
the next.

``test_ops.main`` makes a bare ``PartialState()``, which reads no
``ACCELERATE_USE_CPU`` (``Accelerator()`` does): on a host without a GPU it
would run each rank alone, under torchrun too. So the state is made first
with ``cpu=True``, as ``Accelerator()`` makes it there.
"""

import torch.distributed as dist
import torchrun_script
import trainer_script
from accelerate import PartialState
from accelerate.test_utils.scripts import test_ops, test_sync

if __name__ == "__main__":
    torchrun_script.main()
    dist.init_process_group("mpidp")
    PartialState(cpu=True)
    test_ops.main()
    dist.init_process_group("mpidp")
    test_sync.main()
    dist.init_process_group("mpidp")
    trainer_script.main()
