"""Gradient sets for the benchmark: the tensor shapes of real models, no model code.

Every set is a list of ``(name, shape)`` in the model's own order. Names are
zero-padded so that mpidp's contract order (sorted names) follows the model.
"""

from __future__ import annotations

from itertools import pairwise
from math import prod

import ml_dtypes
import numpy as np

__all__ = ["BF16", "MIXES", "QUICK_SETS", "SETS", "count", "dtype_of", "shapes"]

Shape = tuple[int, ...]
BF16 = np.dtype(ml_dtypes.bfloat16)


def gpt2(layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024) -> list[tuple[str, Shape]]:
    """GPT-2 (Hugging Face layout, lm_head tied to wte): 148 tensors, 124,439,808 parameters at the defaults."""
    out: list[tuple[str, Shape]] = [("wte", (vocab, width)), ("wpe", (context, width))]
    for i in range(layers):
        p = f"h.{i:02d}."
        out += [
            (p + "ln_1.weight", (width,)),
            (p + "ln_1.bias", (width,)),
            (p + "attn.c_attn.weight", (width, 3 * width)),
            (p + "attn.c_attn.bias", (3 * width,)),
            (p + "attn.c_proj.weight", (width, width)),
            (p + "attn.c_proj.bias", (width,)),
            (p + "ln_2.weight", (width,)),
            (p + "ln_2.bias", (width,)),
            (p + "mlp.c_fc.weight", (width, 4 * width)),
            (p + "mlp.c_fc.bias", (4 * width,)),
            (p + "mlp.c_proj.weight", (4 * width, width)),
            (p + "mlp.c_proj.bias", (width,)),
        ]
    out += [("ln_f.weight", (width,)), ("ln_f.bias", (width,))]
    return out


def resnet50(classes: int = 1000) -> list[tuple[str, Shape]]:
    """torchvision ResNet-50 trainable tensors: 161 tensors, 25,557,032 parameters."""
    out: list[tuple[str, Shape]] = [("a.conv1.weight", (64, 3, 7, 7)), ("a.bn1.weight", (64,)), ("a.bn1.bias", (64,))]
    inplanes = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}."
            convs = [(inplanes if b == 0 else width * 4, width, 1), (width, width, 3), (width, width * 4, 1)]
            for k, (cin, cout, ks) in enumerate(convs, start=1):
                out += [(p + f"conv{k}.weight", (cout, cin, ks, ks)), (p + f"bn{k}.weight", (cout,)), (p + f"bn{k}.bias", (cout,))]
            if b == 0:
                out += [
                    (p + "downsample.0.weight", (width * 4, inplanes, 1, 1)),
                    (p + "downsample.1.weight", (width * 4,)),
                    (p + "downsample.1.bias", (width * 4,)),
                ]
        inplanes = width * 4
    out += [("z.fc.weight", (classes, 2048)), ("z.fc.bias", (classes,))]
    return out


def tiny() -> list[tuple[str, Shape]]:
    """A small MLP, latency-bound: 10 tensors, 105,814 parameters."""
    dims = [784, 100, 100, 100, 64, 10]
    out: list[tuple[str, Shape]] = []
    for i, (a, b) in enumerate(pairwise(dims)):
        out += [(f"fc{i}.weight", (b, a)), (f"fc{i}.bias", (b,))]
    return out


#: name -> (description, shapes)
SETS: dict[str, tuple[str, list[tuple[str, Shape]]]] = {
    "gpt2": ("GPT-2 small", gpt2()),
    "resnet50": ("ResNet-50", resnet50()),
    "tiny": ("tiny MLP", tiny()),
}

#: sets of the --quick smoke run: the same layouts, scaled down
QUICK_SETS: dict[str, tuple[str, list[tuple[str, Shape]]]] = {
    "gpt2-mini": ("GPT-2 layout, 2 layers of width 128", gpt2(layers=2, width=128, vocab=4096, context=256)),
    "tiny": ("tiny MLP", tiny()),
}

#: dtype mixes: name -> what the gradients of a set are stored in
MIXES = ("fp32", "mixed", "fp16")


def dtype_of(mix: str, shape: Shape) -> np.dtype:
    """Return the gradient dtype of one tensor in a mix.

    ``mixed`` is the usual bf16 mixed-precision layout: matrices and kernels
    in bfloat16, vectors (biases, norms) in float32.
    """
    if mix == "fp32":
        return np.dtype(np.float32)
    if mix == "fp16":
        return np.dtype(np.float16)
    if mix == "mixed":
        return BF16 if len(shape) >= 2 else np.dtype(np.float32)
    raise ValueError(f"unknown mix {mix!r}")


def shapes(name: str, quick: bool = False) -> tuple[str, list[tuple[str, Shape]]]:
    table = QUICK_SETS if quick else SETS
    if name not in table:
        raise KeyError(f"unknown gradient set {name!r}; choose from {', '.join(table)}")
    return table[name]


def count(layout: list[tuple[str, Shape]]) -> int:
    return sum(prod(s) for _, s in layout)
