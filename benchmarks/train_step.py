"""One whole training step: mpidp against DDP over gloo, the Horovod-style peer and no communication, in one job.

Run it under MPI (every rank runs the same command)::

    mpiexec -n 2 python -m mpi4py benchmarks/train_step.py                  # every model, minutes
    mpiexec -n 4 python -m mpi4py benchmarks/train_step.py --models gpt2-29m --steps 12
    mpiexec -n 2 python -m mpi4py benchmarks/train_step.py --quick          # a CI smoke run, seconds

Every model (built from ``torch.nn``, nothing downloaded) is trained, on every
rank, once per variant, each variant with its own copy of the same initial
weights and its own AdamW; one thread per rank:

* ``local``: one process's step, no communication at all (every rank runs
  it at the same time, so the machine is as loaded as for the others);
* ``mpidp``: ``mpidp.torch.DataParallel(model, flat_parameters=True)``,
  ``dp.reduce(local_weight=tokens)`` after backward, ``dp.zero_grad()``;
* ``mpidp_readme``: the README's loop as it is: ``DataParallel(model, comm)``
  with every default, ``opt.zero_grad()``;
* ``mpidp_exact``, ``mpidp_exact_thread``: ``exact=True`` (integer sums,
  docs/reproducibility.md), plain and with ``overlap="thread"``;
* ``mpidp_overlap``: the same with ``overlap=True`` (auto: the mode it
  picks is recorded as ``overlap_mode``): buckets reduced while backward
  runs, finished by ``reduce``;
* ``mpidp_hooks``, ``mpidp_thread``: the same with ``overlap="hooks"``
  (non-blocking calls progressed by the gradient hooks) and
  ``overlap="thread"`` (a communication thread, blocking calls);
* ``mpidp_thread_weight``: ``overlap="thread"`` with the token count given
  before backward (``dp.expect_weight``), so that the thread divides too;
* ``ddp_gloo``: ``torch.nn.parallel.DistributedDataParallel`` over gloo on
  127.0.0.1 (rank and world from MPI; ``broadcast_buffers=False``, as mpidp's
  buffers are local too), its own 25 MiB buckets reduced during backward;
* ``horovod``: benchmarks/bench.py's Horovod-style peer (its fusion of
  tensors in order into 4 MiB Allreduce calls over MPI, then a division) on
  the ``.grad`` tensors after backward.

The ``offcpu-*`` models are a clearly labelled stand-in for a GPU-like
device: the same parameters (names, shapes, ties) as the real model of that
name, but every module's forward and backward is a ``torch.autograd.Function``
that *sleeps* (``time.sleep``: the core is free and the GIL released, as
while a GPU computes) for a time proportional to its parameter count, and
returns ``torch.full_like`` gradients, so post-accumulate-grad hooks fire
module by module in backward order. The sleeps are calibrated at start-up so
that forward and backward take what the real model's take here (medians over
a few steps, every rank at once, the slowest rank's). The loss is the
output's sum; nothing else is computed.

The variants take turns step by step (the order rotates each step), every
rank in the same variant at the same time, from a barrier. The step is the
slowest rank's whole step (what the job waits for); it is also timed in three
parts, the slowest rank's each: forward+backward (DDP's reduction is inside
it), the reduction left after backward, optimizer step + zero. ``left`` is
what the reduction adds after the *slowest* rank's backward (the end of the
last rank's reduce minus the end of the last rank's backward): a rank whose
backward ends early waits for the others inside the reduce, which the
per-rank part counts but no overlap can hide. Times are
medians over the steps; ratios (against DDP, against no communication,
against mpidp's plain reduction) are medians of the ratios within each
round, so that load changes cancel. The raw MPI limit of the same gradients (a 4 MiB-chunked float32
Allreduce of all of them) and gloo's all_reduce of them are timed in the same
run. Writes ``<out>/train-step-np<N>.json``; nothing gates on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # the Horovod-style peer and the gloo set-up

import mpidp
import mpidp.torch

COMM = MPI.COMM_WORLD
MIB = 1 << 20
VARIANTS = ("local", "mpidp", "mpidp_readme", "mpidp_exact", "mpidp_exact_thread", "mpidp_overlap", "mpidp_hooks", "mpidp_thread", "mpidp_thread_weight", "ddp_gloo", "horovod")
#: ``bucket_bytes=`` of the overlapped variants (--bucket-bytes; None: the default, ``chunk_bytes``)
BUCKET_BYTES: list[int | None] = [None]
#: the ``overlap=`` argument of each mpidp variant
OVERLAP: dict[str, bool | str] = {
    "mpidp": False, "mpidp_readme": False, "mpidp_exact": False, "mpidp_exact_thread": "thread", "mpidp_overlap": True, "mpidp_hooks": "hooks", "mpidp_thread": "thread", "mpidp_thread_weight": "thread",
}


# ------------------------------------------------------------------ models


class Block(nn.Module):
    """A GPT-2 block: pre-LayerNorm causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2's shape from ``torch.nn``: token and position embeddings, blocks, the head tied to the embedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class HuggingFace(nn.Module):
    """Hugging Face's ``GPT2LMHeadModel`` (optional: ``pip install transformers``), randomly initialized; returns the logits."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as e:  # a clear message on every rank, before any collective
            raise SystemExit("the hf-* models need Hugging Face transformers: pip install transformers") from e
        config = GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_positions=context)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(idx).logits


class Residual(nn.Module):
    """ResNet's basic block (two 3x3 convolutions with BatchNorm, a 1x1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


class ResNet(nn.Module):
    """A ResNet-18-like network for 32x32 images: four stages of two basic blocks."""

    def __init__(self, widths: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks += [Residual(cin, w, 1 if i == 0 else 2), Residual(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


#: name -> (model factory, batch factory(rank, generator) -> (input, target)); targets of -100 are ignored
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]]] = {}


def _tokens(vocab: int, batch: int, context: int) -> Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(rank: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(vocab, (batch, context), generator=g)
        target = torch.randint(vocab, (batch, context), generator=g)
        target[:, : rank % 3] = -100  # ranks count different tokens: the exact token mean matters
        return idx, target

    return make


def _images(batch: int, classes: int) -> Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(rank: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(classes, (batch,), generator=g)

    return make


# ---------------------------------------------------- off-CPU stand-ins


class Sleeps(torch.autograd.Function):
    """One off-CPU module: forward and backward sleep (core free, GIL released) and return cheap values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: float, backward: float, *params: torch.Tensor) -> torch.Tensor:
        ctx.backward_seconds, ctx.params = backward, params
        time.sleep(forward)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        time.sleep(ctx.backward_seconds)
        return (g, None, None, *(torch.full_like(p, 1e-3) for p in ctx.params))


class OffCPU(nn.Module):
    """The real model's parameters under the same names; each module with parameters is one :class:`Sleeps` in order."""

    def __init__(self, real: nn.Module, forward: float, backward: float) -> None:
        super().__init__()
        for name, child in real.named_children():
            self.add_module(name, child)
        if isinstance(real, GPT):
            self.head.weight = self.wte.weight  # add_module kept the tie; say it again for the reader
        modules = [list(m.parameters(recurse=False)) for m in self.modules() if m is not self]
        groups = [g for g in modules if g]
        total = sum(p.numel() for g in groups for p in g)  # a tied weight counts where it is used: its work is
        self.layers = [(forward * sum(p.numel() for p in g) / total, backward * sum(p.numel() for p in g) / total, g) for g in groups]

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(1)
        for f, b, params in self.layers:
            x = Sleeps.apply(x, f, b, *params)
        return x


def calibrate(name: str, reps: int = 3) -> tuple[float, float]:
    """The real model's forward and backward seconds here: medians over ``reps`` steps after one, slowest rank's."""
    make, batch = MODELS[name]
    torch.manual_seed(1234)
    model = make()
    x, target = batch(COMM.rank, torch.Generator().manual_seed(COMM.rank + 1))
    times = []
    for r in range(reps + 1):
        COMM.Barrier()
        t0 = time.perf_counter()
        loss = real_loss(model(x), target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad()
        if r:
            parts = np.array([t1 - t0, t2 - t1])
            COMM.Allreduce(MPI.IN_PLACE, parts, MPI.MAX)
            times.append(tuple(parts))
    f, b = (statistics.median(c) for c in zip(*times))
    return float(f), float(b)


def real_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten(), ignore_index=-100, reduction="sum")


def offcpu_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


MODELS["gpt2-29m"] = (lambda: GPT(50257, 384, 6, 6, 32), _tokens(50257, 1, 32))  # 29.7 M parameters, batch 1x32
# the check: Hugging Face GPT-2, 4 layers, width 512, vocabulary 32,000 (29.0 M parameters), batch 1x32
MODELS["hf-gpt2-29m"] = (lambda: HuggingFace(32000, 512, 4, 8, 32), _tokens(32000, 1, 32))
MODELS["gpt2-5m"] = (lambda: GPT(8192, 256, 4, 4, 32), _tokens(8192, 1, 32))
MODELS["resnet-3m"] = (lambda: ResNet((32, 64, 128, 256), 10), _images(8, 10))
MODELS["resnet-11m"] = (lambda: ResNet((64, 128, 256, 512), 10), _images(8, 10))  # ResNet-18's widths
MODELS["resnet-25m"] = (lambda: ResNet((96, 192, 384, 768), 10), _images(8, 10))  # ResNet-50's parameter count
MODELS["gpt2-tiny"] = (lambda: GPT(512, 64, 2, 2, 16), _tokens(512, 1, 16))  # the smoke run's
MODELS["resnet-tiny"] = (lambda: ResNet((8, 16), 10), _images(2, 10))
#: off-CPU stand-ins: name -> the real model they copy (the sleeps are calibrated on it in each run)
OFFCPU = {f"offcpu-{m}": m for m in ("gpt2-5m", "gpt2-29m", "resnet-3m", "resnet-11m", "resnet-25m", "gpt2-tiny")}


# ---------------------------------------------------------------- variants


class Variant:
    """One way to train: a model copy, its optimizer, and the step in three timed parts."""

    def __init__(
        self, name: str, make: Callable[[], nn.Module], state: dict[str, torch.Tensor],
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = real_loss,
    ) -> None:
        self.name = name
        self.loss = loss
        model = make()
        model.load_state_dict(state)
        self.model: nn.Module = model
        self.dp: Any = None
        self.mode: str | None = None  # the overlap mode an mpidp variant runs in
        self.reduce_after: Callable[[int], None] = lambda weight: None
        if name in OVERLAP:
            flat = name != "mpidp_readme"  # the README's loop keeps every default
            exact = name.startswith("mpidp_exact")  # the exact reduction (one micro-batch per window: reduce measures it)
            self.dp = mpidp.torch.DataParallel(model, flat_parameters=flat, overlap=OVERLAP[name], bucket_bytes=BUCKET_BYTES[0], exact=exact)
            self.mode = self.dp.overlap or "off"  # which mode overlap=True picked
            self.reduce_after = lambda weight: self.dp.reduce(local_weight=weight)
        elif name == "ddp_gloo":
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)  # its own advice: keep it
            self.model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "horovod":
            for p in model.parameters():  # persistent .grad, as Horovod's fusion reads and writes them in place
                p.grad = torch.zeros_like(p)
            # the gradients of tied weights once (the same tensor under two names)
            grads = {str(id(p)): p.grad.numpy() for p in dict.fromkeys(model.parameters())}
            fused = bench.horovod_fusion(grads)
            self.reduce_after = lambda weight: fused()

    def step(self, x: torch.Tensor, target: torch.Tensor) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        if self.name == "mpidp_thread_weight":  # the token count is known with the batch
            self.dp.expect_weight(int((target != -100).sum()))
        loss = self.loss(self.model(x), target)
        loss.backward()
        t1 = time.perf_counter()
        self.reduce_after(int((target != -100).sum()))
        t2 = time.perf_counter()
        self.opt.step()
        if self.dp is not None and self.name != "mpidp_readme":
            self.dp.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=self.name != "horovod")
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


def limits(n: int, reps: int) -> dict[str, float]:
    """Medians of the raw MPI limit (4 MiB-chunked float32 Allreduce of ``n`` values), of gloo's all_reduce of them,
    and of one division pass over them (what every reduction does after its sums, into another buffer)."""
    buf = np.ones(n, np.float32)
    into = np.empty_like(buf)
    mpi = bench.raw_allreduce(buf, 4 * MIB)
    t = torch.from_numpy(buf)
    runs: dict[str, Callable[[], Any]] = {
        "mpi_allreduce": mpi, "gloo_allreduce": lambda: dist.all_reduce(t), "division": lambda: np.divide(buf, np.float32(3), out=into),
    }
    out: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(reps + 1):
        for key in sorted(out, reverse=r % 2 == 1):
            COMM.Barrier()
            t0 = time.perf_counter()
            runs[key]()
            dt = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if r:  # the first round warms up
                out[key].append(dt)
    return {k: statistics.median(v) for k, v in out.items()}


def bench_model(name: str, variants: tuple[str, ...], steps: int, warmup: int) -> dict[str, Any]:
    calibrated: tuple[float, float] | None = None
    loss = real_loss
    if name in OFFCPU:
        real_make, batch = MODELS[OFFCPU[name]]
        calibrated = calibrate(OFFCPU[name])
        f, b = calibrated

        def make() -> nn.Module:
            return OffCPU(real_make(), f, b)

        loss = offcpu_loss
    else:
        make, batch = MODELS[name]
    torch.manual_seed(1234)  # the same initial weights everywhere (and mpidp / DDP broadcast rank 0's)
    state = make().state_dict()
    x, target = batch(COMM.rank, torch.Generator().manual_seed(COMM.rank + 1))
    runs = [Variant(v, make, state, loss) for v in variants]
    trainable = dict.fromkeys(p for p in runs[0].model.parameters() if p.requires_grad)
    n = sum(p.numel() for p in trainable)
    times: dict[str, list[tuple[float, ...]]] = {v: [] for v in variants}
    try:
        for s in range(warmup + steps):
            k = s % len(runs)
            for run in runs[k:] + runs[:k]:  # the order rotates: each variant follows each other one
                COMM.Barrier()
                fb, red, opt = run.step(x, target)
                # the parts, when backward and reduce ended, the whole step (each rank's, from the same barrier)
                parts = np.array([fb, red, opt, fb, fb + red, fb + red + opt])
                COMM.Allreduce(MPI.IN_PLACE, parts, MPI.MAX)  # the slowest rank's, part by part
                # what the reduction adds after the slowest rank's backward (a rank that ends early waits in it: not counted)
                left = max(0.0, float(parts[4] - parts[3]))
                if s >= warmup:  # the step: the slowest rank's whole step, what the job waits for
                    times[run.name].append((float(parts[5]), *map(float, parts[:3]), left))
        limit = limits(n, max(3, steps // 2))
    finally:
        for run in runs:
            run.close()
    out: dict[str, Any] = {"parameters": n, "gradient_bytes": 4 * n, "limits": limit, "variants": {}}
    if calibrated is not None:
        out["offcpu"] = {"real_model": OFFCPU[name], "forward_sleep": calibrated[0], "backward_sleep": calibrated[1]}
    modes = {run.name: run.mode for run in runs}
    for v, rows in times.items():
        med = [statistics.median(c) for c in zip(*rows)]
        out["variants"][v] = {
            "step": med[0], "forward_backward": med[1], "reduce_after_backward": med[2], "optimizer": med[3],
            "reduce_after_slowest_backward": med[4],
            "samples": [list(r) for r in rows],
        }
        if modes[v] is not None:
            out["variants"][v]["overlap_mode"] = modes[v]
    for v, r in out["variants"].items():  # ratios of the same round's steps (load changes cancel), medians
        for base in ("ddp_gloo", "local"):
            if base in times:
                r[f"step_vs_{base}"] = paired(times[v], times[base], 0)
        if "local" in times:
            r["forward_backward_vs_local"] = paired(times[v], times["local"], 1)
        if v != "mpidp" and "mpidp" in times:
            # how much of the plain path's reduction after backward is left
            r["reduce_vs_mpidp"] = paired(times[v], times["mpidp"], 2)
            r["left_vs_mpidp"] = paired(times[v], times["mpidp"], 4)
    return out


def paired(rows: list[tuple[float, ...]], base: list[tuple[float, ...]], part: int) -> float:
    """The median over rounds of ``rows[i][part] / base[i][part]``."""
    return statistics.median(a[part] / max(b[part], 1e-9) for a, b in zip(rows, base))


def table(result: dict[str, Any]) -> str:
    meta = result["meta"]
    numba = "installed" if meta.get("numba") else "not installed"
    lines = [
        f"one training step, {meta['world_size']} ranks, medians of {meta['steps']} steps (ms; slowest rank per part); "
        + f"numba {numba}, exact passes: {meta.get('exact_kernels')}"
    ]
    for name, m in result["models"].items():
        lim = m["limits"]
        lines.append(
            f"\n{name}: {m['parameters'] / 1e6:.1f} M parameters; gradients' Allreduce alone: "
            f"MPI {lim['mpi_allreduce'] * 1e3:.1f} ms, gloo {lim['gloo_allreduce'] * 1e3:.1f} ms; one division pass {lim['division'] * 1e3:.1f} ms"
        )
        if "offcpu" in m:
            o = m["offcpu"]
            lines.append(
                f"  OFF-CPU stand-in of {o['real_model']}: sleeps {o['forward_sleep'] * 1e3:.1f} ms forward, "
                f"{o['backward_sleep'] * 1e3:.1f} ms backward (the real model's here); cores free while it 'computes'"
            )
        lines.append(f"  {'variant':20s} {'step':>8s} {'fwd+bwd':>8s} {'reduce':>8s} {'optim':>8s} {'vs DDP':>7s} {'fb/local':>8s} {'red/mpidp':>9s} {'left':>6s} {'left/mpidp':>10s}")
        for v, r in m["variants"].items():
            label = f"{v}({r['overlap_mode']})" if v == "mpidp_overlap" else v
            lines.append(
                f"  {label:20s} {r['step'] * 1e3:8.1f} {r['forward_backward'] * 1e3:8.1f} {r['reduce_after_backward'] * 1e3:8.1f} "
                f"{r['optimizer'] * 1e3:8.1f} {r.get('step_vs_ddp_gloo', float('nan')):7.2f}x {r.get('forward_backward_vs_local', float('nan')):7.2f}x"
                f" {r.get('reduce_vs_mpidp', float('nan')):8.2f}x {r['reduce_after_slowest_backward'] * 1e3:6.1f} {r.get('left_vs_mpidp', float('nan')):9.2f}x"
            )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The docs' table of one result: per model and variant, the step and what is left after backward (medians; ratios as in the JSON)."""
    meta = result["meta"]
    lines = [
        f"{meta['world_size']} ranks, {meta['steps']} steps, load average {meta['load_average_start'][0]:.2f} -> {meta['load_average_end'][0]:.2f}:",
        "",
        "| model | variant | step (ms) | fwd+bwd (ms) | left after slowest bwd (ms) | left vs plain | hidden | fwd+bwd vs local | step vs DDP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else ""

    for name, m in result["models"].items():
        for v, r in m["variants"].items():
            label = f"{v} ({r['overlap_mode']})" if v == "mpidp_overlap" else v
            mpidp = v.startswith("mpidp")  # left vs the plain path: mpidp's variants only (DDP's reduction is inside its backward)
            hidden = f"{(1 - r['left_vs_mpidp']) * 100:.0f}%" if mpidp and "left_vs_mpidp" in r else ""
            lines.append(
                f"| {name} | {label} | {r['step'] * 1e3:.1f} | {r['forward_backward'] * 1e3:.1f} | "
                f"{r['reduce_after_slowest_backward'] * 1e3:.1f} | {ratio(r, 'left_vs_mpidp') if mpidp else ''} | {hidden} | "
                f"{ratio(r, 'forward_backward_vs_local')} | {ratio(r, 'step_vs_ddp_gloo')} |"
            )
        lim = m["limits"]
        what = (
            f"{m['parameters'] / 1e6:.1f} M parameters; Allreduce alone MPI {lim['mpi_allreduce'] * 1e3:.1f} ms, "
            f"gloo {lim['gloo_allreduce'] * 1e3:.1f} ms; division pass {lim['division'] * 1e3:.1f} ms"
        )
        if "offcpu" in m:
            what = f"backward sleeps {m['offcpu']['backward_sleep'] * 1e3:.1f} ms; " + what
        lines.append(f"| {name} | ({what}) | | | | | | | |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-29m,gpt2-5m,resnet-3m", help="comma-separated: " + ", ".join([*MODELS, *OFFCPU]))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--bucket-bytes", type=int, default=None, help="bucket_bytes of the overlapped variants (default: chunk_bytes)")
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 steps: a smoke run")
    ap.add_argument("--out", default="benchmarks/results", help="folder of train-step-np<N>.json")
    ap.add_argument("--markdown", nargs="+", metavar="JSON", help="print the docs' tables of these results and exit (no run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.warmup = "gpt2-tiny,resnet-tiny,offcpu-gpt2-tiny", 2, 1
    args.models = tuple(m for m in args.models.split(",") if m)
    args.variants = tuple(v for v in args.variants.split(",") if v)
    for m in args.models:
        if m not in MODELS and m not in OFFCPU:
            ap.error(f"unknown model {m!r}; choose from {', '.join([*MODELS, *OFFCPU])}")
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    return args


def install() -> dict[str, Any]:
    """What this install gives the exact reduction (issue 41): whether numba serves, whose passes run, which variable chose them."""
    import mpidp.exact

    mode = os.environ.get("MPIDP_EXACT_KERNELS", "auto")
    return {
        "numba": mpidp.exact.route("numba") == "numba", "exact_kernels": mpidp.exact.route(mode.strip().lower() or "auto"),
        "MPIDP_EXACT_KERNELS": os.environ.get("MPIDP_EXACT_KERNELS"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.markdown:
        if COMM.rank == 0:
            print("\n\n".join(markdown(json.loads(Path(p).read_text())) for p in args.markdown))
        return 0
    BUCKET_BYTES[0] = args.bucket_bytes
    torch.set_num_threads(1)  # one thread per rank
    gloo = bench.Gloo()
    started = time.time()
    result: dict[str, Any] = {
        "meta": {
            "command": " ".join([f"mpiexec -n {COMM.size} python -m mpi4py benchmarks/train_step.py", *sys.argv[1:]]),
            "world_size": COMM.size, "steps": args.steps, "warmup": args.warmup, "quick": args.quick, "bucket_bytes": args.bucket_bytes,
            "torch": torch.__version__, "mpi": MPI.Get_library_version().split("\n")[0], "cores": os.cpu_count(),
            "load_average_start": os.getloadavg(), **bench.huge_pages(), **install(),
        },
        "models": {},
    }
    try:
        for name in args.models:
            result["models"][name] = bench_model(name, args.variants, args.steps, args.warmup)
    finally:
        gloo.close()
    result["meta"]["load_average_end"] = os.getloadavg()
    result["meta"]["seconds"] = time.time() - started
    if COMM.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{'quick-' if args.quick else ''}train-step-np{COMM.size}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(table(result))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
