"""Runs of MPIDPStrategy (and DDPStrategy over gloo) for tests/examples/sweep.py (tests/lightning/test_lightning.py): ``main([name, ...], comm)`` -> a JSON text.

Every rank returns the same text (the sweep asserts it): what the run found, computed from values every
rank holds alike after the run (parameters, reduced or gathered values, an error's message), so that a
rank that differs shows. ``example ...`` runs :mod:`mpidp.examples.lightning` with the rest of the argv.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from mpi4py import MPI
from torch.utils.data import DataLoader

from mpidp import ContractError
from mpidp.examples import lightning as example
from mpidp.lightning import MPIDPStrategy, StopOnSignal

DIM, CLASSES, TOKENS = 6, 5, 8


def tokens(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``step``: 8 token vectors, of which ``rank + step`` or (the last of several ranks) none are scored."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(TOKENS, DIM, generator=g), torch.randint(0, CLASSES, (TOKENS,), generator=g)
    scored = 0 if size > 1 and rank == size - 1 else min(TOKENS, 1 + rank + step)
    y[scored:] = -100
    return x, y


class Net(L.LightningModule):
    """A linear classifier of token vectors; ``kind``: "sum" returns the loss sum and its weight, "mean" the mean loss."""

    def __init__(self, kind: str, optimizer: str = "adamw", schedule: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
        self.kind, self.optimizer, self.schedule = kind, optimizer, schedule

    def training_step(self, batch: Any, _: int) -> Any:
        x, y = batch[0][0], batch[1][0]
        if self.kind == "sum":
            return {"loss": F.cross_entropy(self.net(x), y, ignore_index=-100, reduction="sum"), "weight": int((y != -100).sum())}
        return F.cross_entropy(self.net(x), y.clamp(min=0))

    def configure_optimizers(self) -> Any:
        groups = [{"params": self.net[0].parameters(), "weight_decay": 0.1}, {"params": self.net[2].parameters(), "weight_decay": 0.0}]
        opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}[self.optimizer](groups, lr=0.05)
        if not self.schedule:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def data(rank: int, size: int, steps: int) -> DataLoader:
    """This rank's micro-batches (no distributed sampler: each rank its own, uneven ones)."""
    batches = [tokens(rank, s, size) for s in range(steps)]
    return DataLoader([(x, y) for x, y in batches], batch_size=1)


def trainer(strategy: Any, steps: int, accumulate: int = 1, **options: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=options.pop("devices", 1), max_epochs=options.pop("epochs", 1),
                     max_steps=steps, accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=options.pop("checkpointing", False),
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **options)


def reference(kind: str, size: int, steps: int, accumulate: int, clip: float | None, optimizer: str = "adamw", skip: int = 0) -> Net:
    """One process: the same windows, the global token mean (sum) or the mean of the ranks' means (mean, as DDP); the first
    ``skip`` windows are not stepped (a GradScaler's windows that overflowed)."""
    net = Net(kind, optimizer)
    opt = net.configure_optimizers()
    for w in range(skip, steps):
        total = torch.zeros(())
        weight = 0
        for r in range(size):
            for j in range(accumulate):
                x, y = tokens(r, w * accumulate + j, size)
                if kind == "sum":
                    total = total + F.cross_entropy(net.net(x), y, ignore_index=-100, reduction="sum")
                    weight += int((y != -100).sum())
                else:
                    total = total + F.cross_entropy(net.net(x), y.clamp(min=0)) / (size * accumulate)
        (total / weight if kind == "sum" else total).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return net


def distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def window(kind: str, comm: MPI.Comm, clip: float | None = 0.05, optimizer: str = "adamw", skip: int = 0, **options: Any) -> dict[str, Any]:
    """Two windows of two micro-batches: the strategy's parameters against the one-process reference."""
    net = Net(kind, optimizer)
    strategy = MPIDPStrategy(comm)
    run = trainer(strategy, 2, 2, gradient_clip_val=clip, **options)
    run.fit(net, data(comm.rank, comm.size, 4))
    strategy.close()
    plugin = run.precision_plugin
    return {"steps": run.global_step, "distance": distance(net, reference(kind, comm.size, 2, 2, clip, optimizer, skip)),
            "world": run.world_size, "digest": example.digest(net), "precision": getattr(plugin, "precision", None),
            "scale": plugin.scaler.get_scale() if getattr(plugin, "scaler", None) is not None else None}


def precisions(comm: MPI.Comm) -> dict[str, Any]:
    """precision="16-mixed" on a CPU (Lightning runs bf16-mixed), and 16-mixed with a GradScaler (Lightning's MixedPrecision
    plugin, which runs on a CPU): the reduced gradients are unscaled, the overflowed window skipped on every rank."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return {"16-mixed": window("sum", comm, precision="16-mixed"), "bf16-mixed": window("sum", comm, precision="bf16-mixed"),
            "scaler": window("sum", comm, optimizer="sgd", skip=1, plugins=[MixedPrecision("16-mixed", "cpu")])}


class Mixed(Net):
    """A loss sum with its weight, a mean loss, or a sum with a negative weight, as ``pick(rank, batch index)`` says."""

    def __init__(self, pick: Any) -> None:
        super().__init__("sum")
        self.pick = pick

    def training_step(self, batch: Any, i: int) -> Any:
        x, y = batch[0][0], batch[1][0]
        kind = self.pick(self.global_rank, i)
        if kind == "mean":
            return F.cross_entropy(self.net(x), y.clamp(min=0))
        return {"loss": F.cross_entropy(self.net(x), y, ignore_index=-100, reduction="sum"), "weight": -1 if kind == "bad" else int((y != -100).sum())}


def kinds(comm: MPI.Comm) -> dict[str, Any]:
    """Two kinds of loss in one window (across the ranks, or on each rank), a bad weight: one ContractError, the same on
    every rank (the sweep compares them), before any gradient moved: the parameters as they were."""
    cases = {"across ranks": lambda r, i: "sum" if r == 0 else "mean", "within a window": lambda r, i: ("sum", "mean")[i % 2],
             "bad weight": lambda r, i: "bad" if r == comm.size - 1 else "sum"}
    out: dict[str, Any] = {}
    for name, pick in cases.items():
        net = Mixed(pick)
        before = example.digest(net)
        strategy = MPIDPStrategy(comm)
        try:
            trainer(strategy, 2, 2).fit(net, data(comm.rank, comm.size, 4))
            out[name] = None
        except ContractError as e:
            out[name] = {"error": str(e), "untouched": example.digest(net) == before}
        strategy.close()
    return out


class Manual(Net):
    """Manual optimization: a mean loss, manual_backward, one replicated optimizer stepped by hand."""

    def __init__(self) -> None:
        super().__init__("mean")
        self.automatic_optimization = False

    def training_step(self, batch: Any, _: int) -> None:
        opt = self.optimizers()
        x, y = batch[0][0], batch[1][0]
        self.manual_backward(F.cross_entropy(self.net(x), y.clamp(min=0)))
        opt.step()
        opt.zero_grad()


def manual(comm: MPI.Comm) -> dict[str, Any]:
    """Manual optimization with a replicated AdamW: each opt.step() reduces a mean, as DDP."""
    net = Manual()
    strategy = MPIDPStrategy(comm)
    run = trainer(strategy, 3, 1)
    run.fit(net, data(comm.rank, comm.size, 3))
    strategy.close()
    return {"steps": run.global_step, "distance": distance(net, reference("mean", comm.size, 3, 1, None))}


def ddp(comm: MPI.Comm) -> dict[str, Any]:
    """DDPStrategy over gloo on the world (Lightning's MPIEnvironment): the parameters, to compare with the mean run's."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import MPIEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    net = Net("mean")
    run = trainer(DDPStrategy(process_group_backend="gloo", cluster_environment=MPIEnvironment()), 2, 2, gradient_clip_val=0.05,
                  devices=comm.size)  # one host: Lightning's local rank is the rank
    run.fit(net, data(comm.rank, comm.size, 4))
    dist.destroy_process_group()
    return {"steps": run.global_step, "params": [round(v, 5) for p in net.parameters() for v in p.detach().reshape(-1).tolist()]}


def mean_params(comm: MPI.Comm) -> dict[str, Any]:
    """The mean run's parameters, rounded as :func:`ddp`'s."""
    net = Net("mean")
    strategy = MPIDPStrategy(comm)
    trainer(strategy, 2, 2, gradient_clip_val=0.05).fit(net, data(comm.rank, comm.size, 4))
    strategy.close()
    return {"params": [round(v, 5) for p in net.parameters() for v in p.detach().reshape(-1).tolist()]}


def sharded(comm: MPI.Comm) -> dict[str, Any]:
    """sharded=True: AdamW with two groups and a StepLR becomes ShardedAdamW; the same parameters as replicated, within float32."""
    out: dict[str, Any] = {}
    nets = {}
    for shard in (False, True):
        net = Net("sum", schedule=True)
        strategy = MPIDPStrategy(comm, sharded=shard)
        run = trainer(strategy, 3, 1)
        run.fit(net, data(comm.rank, comm.size, 3))
        opt = run.optimizers[0]
        nets[shard] = net
        out[str(shard)] = {"optimizer": type(opt).__name__, "lr": [g["lr"] for g in opt.param_groups],
                           "weight_decay": [g["weight_decay"] for g in opt.param_groups]}
        if shard:
            out["state bytes"] = comm.allreduce(opt.sharded.nbytes)  # the slices add up to the whole state
        strategy.close()
    out["distance"] = distance(nets[False], nets[True])
    return out


def refused(comm: MPI.Comm) -> dict[str, Any]:
    """What the strategy cannot run: one ContractError, the same text on every rank (the sweep compares them)."""
    cases = {
        "rmsprop": (lambda: MPIDPStrategy(comm, sharded=True), Net("sum", optimizer="rmsprop"), {}),
        "ddp option": (lambda: MPIDPStrategy(comm, find_unused_parameters=True), Net("sum"), {}),
        "clip by value": (lambda: MPIDPStrategy(comm, sharded=True), Net("sum"), {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}),
    }
    out = {}
    for name, (make, net, options) in cases.items():
        strategy = make()
        try:
            trainer(strategy, 1, **options).fit(net, data(comm.rank, comm.size, 1))
            out[name] = None
        except ContractError as e:
            out[name] = str(e)
        strategy.close()
    return out


class Logs(Net):
    """Logs its rank with sync_dist and runs every collective of the strategy in its training step."""

    def training_step(self, batch: Any, i: int) -> Any:
        s, rank = self.trainer.strategy, self.global_rank
        self.log("rank", float(rank), sync_dist=True, on_step=False, on_epoch=True)
        mine = torch.tensor([rank, 10 * rank], dtype=torch.int64)
        self.found = {
            "mean": s.reduce(torch.tensor(float(rank)), reduce_op="mean").item(),
            "sum": s.reduce(mine, reduce_op="sum").tolist(), "max": s.reduce(mine, reduce_op="max").tolist(),
            "untouched": mine.tolist() == [rank, 10 * rank],
            "gathered": self.all_gather(mine).tolist(),
            "broadcast": s.broadcast({"from": rank, "t": torch.ones(2) * rank}, src=s.world_size - 1)["from"],
            "seen": self.all_gather(batch.reshape(-1)).reshape(-1).tolist(),
            "decision": s.reduce_boolean_decision(rank == 0, all=False),
        }
        s.barrier()
        return self.net(torch.ones(1, DIM)).sum()


def collectives(comm: MPI.Comm) -> dict[str, Any]:
    """reduce, all_gather, broadcast, barrier, self.log(sync_dist=True), the distributed sampler, world_size."""
    net = Logs("mean")
    strategy = MPIDPStrategy(comm)
    run = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    run.fit(net, DataLoader(torch.arange(2 * comm.size), batch_size=1))
    strategy.close()
    return {**net.found, "logged": float(run.callback_metrics["rank"]), "world": run.world_size,
            "sampler": strategy.distributed_sampler_kwargs["num_replicas"]}


class Counter(Callback):
    """A callback with state: how many batches it saw, restored from a checkpoint; the parameters' digest at each epoch's end."""

    def __init__(self) -> None:
        self.batches = 0
        self.digests: list[str] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.digests.append(example.digest(module))  # before ModelCheckpoint's save: Lightning runs checkpoint callbacks last

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = state["batches"]


def checkpoints(comm: MPI.Comm, folder: str, resume: bool) -> dict[str, Any]:
    """ModelCheckpoint every epoch for 2 epochs (save), or fit(ckpt_path=the first epoch's) to 3 epochs (resume), any world size;
    then validate (save), or validate and test new modules with ckpt_path= the saving run's checkpoints (resume)."""
    net = Scored("sum", schedule=True)
    strategy = MPIDPStrategy(comm)
    saving = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    counter = Counter()
    run = trainer(strategy, -1, 1, epochs=3 if resume else 2, checkpointing=True, callbacks=[saving, counter])
    loader = DataLoader([tokens(0, s, 1) for s in range(2)], batch_size=1)  # the same batches on every rank
    run.fit(net, loader, ckpt_path=str(Path(folder) / "epoch=0.ckpt") if resume else None)
    files = sorted(p.name for p in Path(folder).iterdir() if p.name.endswith(".ckpt"))
    out = {"epoch": run.current_epoch, "steps": run.global_step, "batches": counter.batches, "lr": run.optimizers[0].param_groups[0]["lr"],
           "files": files, "scheduler epoch": run.lr_scheduler_configs[0].scheduler.last_epoch, "digests": counter.digests,
           "digest": example.digest(net), "rank files": len(list((Path(folder) / "epoch=0.ckpt").glob("rank-*")))}
    if resume:  # the saving run's checkpoints into new modules: validate on this fit's Trainer, test on a new one
        out["validate"] = evaluate(run, "validate", Path(folder) / "epoch=1.ckpt", loader)
        fresh = MPIDPStrategy(comm)
        out["test"] = evaluate(trainer(fresh, -1), "test", Path(folder) / "epoch=0.ckpt", loader)
        fresh.close()
    else:
        out["validate"] = run.validate(net, loader, verbose=False)[0]["loss"]  # the fit's own last parameters
    strategy.close()
    return out


class Signals(Net):
    """Rank ``sender`` sends itself SIGUSR1 in the first training step of epoch 1 (None: no rank does)."""

    def __init__(self, sender: int | None) -> None:
        super().__init__("sum")
        self.sender = sender

    def training_step(self, batch: Any, i: int) -> Any:
        if self.current_epoch == 1 and i == 0 and self.global_rank == self.sender:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().training_step(batch, i)


def stop(comm: MPI.Comm, folder: str) -> dict[str, Any]:
    """StopOnSignal, 4 epochs of one window of 2 micro-batches: the last rank's SIGUSR1 in epoch 1 stops every rank after
    that window with a checkpoint; fit(ckpt_path=folder) goes on; and a run that no signal stops."""
    out: dict[str, Any] = {}
    for name, sender, resume in (("whole", None, False), ("stopped", comm.size - 1, False), ("resumed", None, True)):
        net = Signals(sender)
        strategy = MPIDPStrategy(comm)
        stopping = StopOnSignal(folder)
        run = trainer(strategy, -1, 2, epochs=4, callbacks=[stopping])
        run.fit(net, data(comm.rank, comm.size, 2), ckpt_path=folder if resume else None)
        strategy.close()
        out[name] = {"steps": run.global_step, "epoch": run.current_epoch, "digest": example.digest(net),
                     "saved": None if stopping.saved is None else stopping.saved.name}
    out["rank files"] = len(list((Path(folder) / "step-000002").glob("rank-*")))
    out["handler"] = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back at the end of fit
    return out


class Scored(Net):
    """A Net with validation and test steps that log the mean loss over the ranks (every rank sees the same batches)."""

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("loss", F.cross_entropy(self.net(batch[0][0]), batch[1][0].clamp(min=0)), sync_dist=True)

    def test_step(self, batch: Any, i: int) -> None:
        self.validation_step(batch, i)


def evaluate(run: L.Trainer, how: str, path: Path, loader: DataLoader) -> dict[str, Any]:
    """``run.validate`` or ``run.test`` of a new module with ``ckpt_path=path``: the loaded parameters' digest and the logged loss."""
    net = Scored("sum", schedule=True)
    loss = getattr(run, how)(net, loader, ckpt_path=str(path), verbose=False)[0]["loss"]
    return {"digest": example.digest(net), "loss": loss}


def fabric(comm: MPI.Comm, folder: str) -> dict[str, Any]:
    """MPIDPFabricStrategy: fabric.backward(loss_sum, weight=n), clip, step; replicated and sharded; save and load."""
    from lightning.fabric import Fabric

    from mpidp.lightning import MPIDPFabricStrategy

    out: dict[str, Any] = {}
    nets = {}
    for shard in (False, True):
        strategy = MPIDPFabricStrategy(comm, sharded=shard)
        f = Fabric(strategy=strategy, accelerator="cpu", devices=1)
        f.launch()
        net = Net("sum")
        model, opt = f.setup(net.net, net.configure_optimizers())
        for w in range(2):
            for j in range(2):
                x, y = tokens(comm.rank, 2 * w + j, comm.size)
                f.backward(F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum"), weight=int((y != -100).sum()))
            f.clip_gradients(model, opt, max_norm=0.05)
            opt.step()
            opt.zero_grad()
        nets[shard] = net
        out[f"distance sharded={shard}"] = distance(net, reference("sum", comm.size, 2, 2, 0.05))
        f.save(str(Path(folder) / f"sharded-{shard}"), {"model": model, "optimizer": opt, "windows": 2})
        before = example.digest(net)
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        state = {"model": model, "optimizer": opt, "windows": 0}
        rest = f.load(str(Path(folder) / f"sharded-{shard}"), state)
        out[f"loaded sharded={shard}"] = [example.digest(net) == before, state["windows"], sorted(rest)]
        out["world"] = f.world_size
        strategy.close()
    return {**out, **fabric_overlap(comm)}


def fabric_overlap(comm: MPI.Comm) -> dict[str, Any]:
    """exact=True, plain and overlap="thread": fabric.no_backward_sync around each window's first micro-batch; the same bits."""
    from lightning.fabric import Fabric

    from mpidp.lightning import MPIDPFabricStrategy

    out: dict[str, Any] = {}
    for overlap in (False, "thread"):
        strategy = MPIDPFabricStrategy(comm, exact=True, overlap=overlap)
        f = Fabric(strategy=strategy, accelerator="cpu", devices=1)
        f.launch()
        net = Net("sum")
        model, opt = f.setup(net.net, net.configure_optimizers())
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for w in range(2):
                for j in range(2):
                    x, y = tokens(comm.rank, 2 * w + j, comm.size)
                    with f.no_backward_sync(model, enabled=j == 0):
                        f.backward(F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum"), weight=int((y != -100).sum()))
                opt.step()
                opt.zero_grad()
        out[f"overlap={overlap}"] = {"digest": example.digest(net), "distance": distance(net, reference("sum", comm.size, 2, 2, None)),
                                     "mode": strategy.dp.overlap if strategy.dp is not None else "none",
                                     "warned": sorted({str(m.message)[:60] for m in warned if "synchroniz" in str(m.message)})}
        strategy.close()
    return out


def main(argv: list[str], comm: MPI.Comm | None = None) -> str:
    """Run scenario ``argv[0]`` on ``comm`` (the world by default); its findings as JSON text, the same on every rank."""
    comm = MPI.COMM_WORLD if comm is None else comm
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    name, rest = argv[0], argv[1:]
    if name == "example":
        return example.main(rest, comm)
    runs = {
        "sum": lambda: window("sum", comm), "mean": lambda: window("mean", comm), "manual": lambda: manual(comm), "ddp": lambda: ddp(comm),
        "mean-params": lambda: mean_params(comm), "sharded": lambda: sharded(comm), "refused": lambda: refused(comm),
        "precisions": lambda: precisions(comm), "kinds": lambda: kinds(comm), "stop": lambda: stop(comm, rest[0]),
        "collectives": lambda: collectives(comm), "save": lambda: checkpoints(comm, rest[0], False),
        "resume": lambda: checkpoints(comm, rest[0], True), "fabric": lambda: fabric(comm, rest[0]),
    }
    return json.dumps(runs[name](), sort_keys=True)
