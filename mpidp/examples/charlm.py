"""A tiny character-level language model trained on ragged sentences split unevenly over ranks.

Run: ``mpiexec -n 4 python -m mpi4py -m mpidp.examples.charlm [--steps N] [--save DIR] [--resume DIR]``

The sentences are made up on the fly: words of a random vocabulary chained
by a fixed random grammar, so there is something to learn and nothing to
download. Every step each rank draws its own number of sentences of its own
lengths (rank r up to 3 * (r + 1); the last rank draws none every fourth
step), and the first word of each sentence is a prompt that is not scored
(``ignore_index``). So ranks see very different token counts, and the only
correct gradient is the mean over every scored token of the global batch:
each rank back-propagates its loss *sum* and passes its token count to
``dp.reduce``. The model is a two-layer causal transformer whose output
layer is tied to its embedding.

``--save DIR`` writes a checkpoint (:mod:`mpidp.checkpoint`: every rank its
share of the model and of AdamW's state, and the step) into ``DIR`` at the
end, or earlier when any rank gets SIGUSR1 or SIGTERM (a batch system's
warning before the time limit: every rank stops after the same step);
``--resume DIR`` continues from ``DIR``'s newest checkpoint to ``--steps``
steps in all, at this job's world size, whatever it was. Each rank's data
of step ``s`` comes from a generator seeded with ``(seed, s, rank)``, so
a run resumed at the same world size is bitwise the run that never
stopped.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp.torch
from mpidp import checkpoint
from mpidp.examples import parse_args

ALPHABET = "abcdefghijklmnopqrstuvwxyz ."
PAD, BOS = 0, 1  # then the alphabet
VOCAB = 2 + len(ALPHABET)
IGNORE = -100


class Language:
    """A made-up language: 64 random words, each followed by one of 3 fixed successors."""

    def __init__(self, seed: int = 1234, words: int = 64) -> None:
        rng = np.random.default_rng(seed)
        letters = ALPHABET[:26]
        self.words = ["".join(rng.choice(list(letters), size=rng.integers(2, 7))) for _ in range(words)]
        self.successors = rng.integers(0, words, size=(words, 3))

    def sentence(self, rng: np.random.Generator, context: int) -> tuple[list[int], list[int]]:
        """Return one sentence's tokens and labels; the prompt (first word) is not scored."""
        w = int(rng.integers(len(self.words)))
        text = [self.words[w]]
        for _ in range(int(rng.integers(2, 9))):
            w = int(self.successors[w, rng.integers(3)])
            text.append(self.words[w])
        chars = (" ".join(text) + ".")[: context - 1]
        tokens = [BOS] + [2 + ALPHABET.index(c) for c in chars]
        labels = tokens[1:] + [IGNORE]
        labels[-1] = IGNORE  # nothing follows the full stop
        for i in range(len(text[0])):
            labels[i] = IGNORE  # the prompt
        return tokens, labels


def batch(rng: np.random.Generator, lang: Language, n: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sentences right-padded to the longest: tokens and labels, shape ``(n, T)``."""
    pairs = [lang.sentence(rng, context) for _ in range(n)]
    width = max((len(t) for t, _ in pairs), default=1)
    tokens = torch.full((n, width), PAD, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    for i, (t, y) in enumerate(pairs):
        tokens[i, : len(t)] = torch.tensor(t)
        labels[i, : len(y)] = torch.tensor(y)
    return tokens, labels


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # causal attention: with right padding no real token ever sees a pad
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """A causal transformer whose output layer is its token embedding (tied weights)."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter under two names
        for e in (self.embed, self.pos):
            nn.init.normal_(e.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@torch.no_grad()
def sample(model: CharLM, lang: Language, rng: np.random.Generator, context: int, length: int = 60) -> str:
    """Continue a random prompt word greedily, up to a full stop."""
    prompt = lang.words[int(rng.integers(len(lang.words)))]
    tokens = [BOS] + [2 + ALPHABET.index(c) for c in prompt]
    while len(tokens) < min(context, len(prompt) + 1 + length) and tokens[-1] != 2 + ALPHABET.index("."):
        nxt = int(model(torch.tensor([tokens])).argmax(-1)[0, -1])
        if nxt < 2:
            break
        tokens.append(nxt)
    return "".join(ALPHABET[t - 2] for t in tokens[1:])


@dataclass
class Summary:
    """What a run did, as rank 0 prints it (returned on every rank)."""

    steps: int
    tokens: int
    loss: float  # mean loss per scored token over the last 10 % of the steps
    seconds: float
    model: CharLM


def progress_bar(steps: range, rank: int) -> Any:
    """A tqdm bar over ``steps`` on rank 0 when tqdm is installed, else None."""
    if rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(steps, desc="charlm", unit="step", dynamic_ncols=True)


def main(argv: list[str] | None = None) -> Summary:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run included)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="folder of checkpoints: one at the end, or at a stop signal (SIGUSR1, SIGTERM)")
    parser.add_argument("--resume", type=Path, help="folder of checkpoints to continue from (its newest)")
    args = parse_args(parser, argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # ranks share the cores

    lang = Language()
    torch.manual_seed(args.seed + rank)  # every rank its own init: the wrapper broadcasts root's
    model = CharLM(context=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    dp = mpidp.torch.DataParallel(model, comm)  # every rank agrees on the model; root's values everywhere
    start = 0
    if args.resume is not None:  # written at any world size; every rank reads what it needs
        start = dp.load_checkpoint(args.resume, optimizer)["step"]
    stop = checkpoint.StopSignal(dp, (signal.SIGUSR1, signal.SIGTERM)) if args.save is not None else None
    losses: list[float] = []
    tokens_seen = 0
    t0 = time.perf_counter()
    steps = range(start + 1, args.steps + 1)
    bar = progress_bar(steps, rank)
    done = start
    for step in steps if bar is None else bar:
        rng = np.random.default_rng([args.seed, step, rank])  # every rank its own data, step by step
        # uneven shards: rank r draws up to 3 * (r + 1) sentences; the last rank none every 4th step
        n = 0 if (size > 1 and rank == size - 1 and step % 4 == 0) else int(rng.integers(rank == 0, 3 * (rank + 1) + 1))
        loss_sum = torch.zeros(())
        n_tokens = 0
        if n:
            tokens, labels = batch(rng, lang, n, args.context)
            logits = model(tokens)
            loss_sum = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=IGNORE, reduction="sum")
            n_tokens = int((labels != IGNORE).sum())
            loss_sum.backward()  # the gradient of the loss SUM over this rank's tokens
        global_tokens = dp.reduce(local_weight=n_tokens)  # .grad: the mean over every rank's tokens
        optimizer.step()
        dp.zero_grad()  # in place: .grad stays in mpidp's flat gradient storage
        loss = comm.allreduce(loss_sum.item()) / global_tokens  # user traffic; mpidp keeps its own communicator
        losses.append(loss)
        tokens_seen += global_tokens
        rate = f"{tokens_seen / (time.perf_counter() - t0):,.0f}"
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=rate, refresh=False)
        elif rank == 0 and step % 50 == 0:
            print(f"step {step:5d}  loss {loss:.3f}  {rate} tokens/s", flush=True)
        done = step
        if stop is not None and step < args.steps and stop.requested():  # one rank's signal stops every rank here
            if rank == 0:
                print(f"stop requested: saving at step {step}", flush=True)
            break
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    dp.verify_replicas()  # every rank holds bitwise the same model
    tail = losses[-max(1, len(losses) // 10) :]
    summary = Summary(done - start, tokens_seen, sum(tail) / len(tail) if losses else math.nan, seconds, model)
    if rank == 0:
        print(
            f"charlm: {summary.steps} steps on {size} ranks, {tokens_seen:,} scored tokens in {seconds:.1f} s "
            f"({tokens_seen / max(seconds, 1e-9):,.0f} tokens/s); loss {summary.loss:.3f} "
            f"(uniform guess {math.log(VOCAB):.3f}); replicas bitwise equal"
        )
        print(f"sample: {sample(model, lang, np.random.default_rng(args.seed), args.context)!r}")
    if args.save is not None and stop is not None:
        path = dp.save_checkpoint(args.save, optimizer, extras={"step": done}, tag=f"step-{done:08d}")
        stop.close()
        if rank == 0:
            print(f"saved {path} (step {done}, {size} ranks)")
    dp.close()
    return summary


if __name__ == "__main__":
    main()
