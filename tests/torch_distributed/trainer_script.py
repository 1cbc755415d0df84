"""A tiny Hugging Face ``Trainer`` run, written as for torchrun (run by test_clients.py under mpidp.torch.run, 2 ranks).

A 2-layer GPT-2 made from its config (nothing downloaded) learns a
synthetic token set for a few steps. Each rank prints its world size, its
loss and a hash of its parameters: the same on every rank once DDP has
averaged the gradients.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """64 sequences of 16 tokens that repeat a pattern: learnable in a few steps."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) * (1 + i % 3) + i) % 50
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, use_cpu=True,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        result = trainer.train()
    digest = hashlib.sha256(b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in model.parameters()))
    print(f"trainer rank {args.process_index} world {args.world_size} mode {args.parallel_mode.value} "
          f"steps {result.global_step} loss {result.training_loss:.4f} params {digest.hexdigest()}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
