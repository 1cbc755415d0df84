"""MPIDPStrategy under lightning.pytorch.Trainer at 1 to 4 ranks, and the Lightning example (mpidp.examples.lightning).

Every run is one ``Trainer.fit`` in ONE 4-rank job (tests/examples/sweep.py over
tests/examples/lightning_scenarios.py), each on the world's first n ranks: the job's processes import torch
and Lightning once. Every rank of a run returns the same JSON text of what it found (the sweep asserts
that all ranks agree), so each test below checks every rank. References: one process computing the same
windows, and DDPStrategy over gloo on the whole world.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import sweep
from mpi4py import MPI

pytest.importorskip("lightning")
from mpidp import checkpoint

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job")
EXACT = ["example", "--exact", "--steps", "3"]
#: (key, ranks, argv); an argument ending in "ckpt" is a folder of the job's tmp folder
PLAN: list[tuple[Any, int, list[str]]] = [
    *((("whole", n), n, EXACT) for n in (1, 2, 3, 4)),
    ("saved", 4, [*EXACT, "--save", "ckpt", "--stop-after", "2"]),
    ("resumed", 3, [*EXACT, "--resume", "ckpt"]),
    *((("bf16", n), n, ["example", "--exact", "--steps", "2", "--precision", "bf16-mixed"]) for n in (1, 2)),
    # 2 ranks first: a process's first bfloat16 step costs seconds, and so ranks 0 and 1 pay it side by side
    *((("bf16-true", n), n, ["example", "--exact", "--steps", "1", "--precision", "bf16-true", "--context", "16"]) for n in (2, 1)),
    *((("sharded", n), n, ["example", "--exact", "--steps", "2", "--sharded"]) for n in (1, 3)),
    ("sharded-saved", 3, ["example", "--exact", "--steps", "2", "--sharded", "--save", "sharded-ckpt", "--stop-after", "1"]),
    ("sharded-resumed", 2, ["example", "--exact", "--steps", "2", "--sharded", "--resume", "sharded-ckpt"]),
    ("float32", 2, ["example", "--steps", "3"]),
    ("overlap", 2, [*EXACT, "--overlap", "thread"]),
    *((("sum", n), n, ["sum"]) for n in (1, 3, 4)),
    ("mean", 2, ["mean"]),
    ("manual", 3, ["manual"]),
    ("ddp", 4, ["ddp"]),
    ("mean-params", 4, ["mean-params"]),
    ("sharded-optimizer", 3, ["sharded"]),
    ("refused", 2, ["refused"]),
    ("kinds", 3, ["kinds"]),
    ("precisions", 2, ["precisions"]),
    *((("collectives", n), n, ["collectives"]) for n in (1, 4)),
    ("save", 4, ["save", "model-ckpt"]),
    ("resume", 2, ["resume", "model-ckpt"]),
    ("stop", 2, ["stop", "stop-ckpt"]),
    ("fabric", 3, ["fabric", "fabric-ckpt"]),
]
Runs = dict[Any, Any]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Path]:
    """Every run's finding (the example's: its sha256 hex, printed once), and the job's folder."""
    folder = tmp_path_factory.mktemp("lightning")
    plan = [(n, [str(folder / a) if a.endswith("ckpt") else a for a in argv]) for _, n, argv in PLAN]
    out: Runs = {}
    for (key, _, argv), r in zip(PLAN, sweep("lightning_scenarios", 4, plan, folder, timeout=400)):
        found = r["returned"][0]
        if argv[0] == "example":
            printed = "".join(r["printed"])
            last = r["printed"][0].strip().splitlines()[-1].split()
            assert printed.count("sha256") == 1 and last == ["sha256", found], printed
            out[key] = found
        else:
            out[key] = json.loads(found)
    return out, folder


@pytest.mark.time_limit(400)
def test_exact_hash_is_the_same_at_1_to_4_ranks_and_after_a_resume_at_another(runs: tuple[Runs, Path]) -> None:
    """accumulate_grad_batches (12/N micro-batches per rank, each folded), gradient_clip_val, a StepLR: one hash."""
    done, folder = runs
    whole = {n: done["whole", n] for n in (1, 2, 3, 4)}
    assert len(set(whole.values())) == 1, whole
    assert done["saved"] != whole[1] and done["resumed"] == whole[1]  # saved at 4 ranks after 2 steps, resumed at 3
    assert checkpoint.latest(folder / "ckpt") == folder / "ckpt" / "step-000002"
    assert len(list((folder / "ckpt" / "step-000002").glob("rank-*.safetensors"))) == 4  # each rank wrote its slices
    assert done["float32"] != whole[1]  # the float32 path: other bits, so the exact ones are not a coincidence
    assert done["overlap"] == whole[1]  # overlap="thread": the micro-batches but the last folded under no_sync


def test_bf16_mixed_and_sharded_runs_are_the_same_at_every_world_size(runs: tuple[Runs, Path]) -> None:
    done, _ = runs
    assert done["bf16", 1] == done["bf16", 2] != done["whole", 1]
    assert done["sharded", 1] == done["sharded", 3] == done["sharded-resumed"] != done["sharded-saved"]


def test_bf16_true_gives_the_same_bits_at_every_world_size(runs: tuple[Runs, Path]) -> None:
    """precision="bf16-true": bfloat16 parameters and gradients, reduced in float32 (one step of 12 micro-batches, 12 or 6 per
    rank; short sentences, as bfloat16 matmuls are slow on a CPU)."""
    done, _ = runs
    assert done["bf16-true", 1] == done["bf16-true", 2]  # without exact=True they differ (bfloat16 .grad sums of other lengths)


def test_16_mixed_runs_as_bf16_mixed_on_a_cpu_and_a_grad_scaler_sees_the_reduced_gradients(runs: tuple[Runs, Path]) -> None:
    """precision="16-mixed" on a CPU is Lightning's bf16-mixed; Lightning's MixedPrecision("16-mixed", "cpu") plugin runs
    fp16 autocast with a GradScaler: its unscale, inf check and skip act on the reduced gradients, alike on every rank."""
    found = runs[0]["precisions"]
    assert found["16-mixed"]["precision"] == "bf16-mixed" and found["16-mixed"]["digest"] == found["bf16-mixed"]["digest"]
    assert found["bf16-mixed"]["distance"] < 3e-3 and found["bf16-mixed"]["steps"] == 2  # against one float32 process
    scaled = found["scaler"]
    assert scaled["precision"] == "16-mixed" and scaled["steps"] == 2
    assert scaled["scale"] == 2.0**15  # the first window overflowed at 2**16: skipped on every rank, the scale halved once
    assert scaled["distance"] < 2e-3, scaled  # against one float32 process (SGD) that skips the first window


def test_a_loss_sum_and_a_mean_loss_in_one_window_are_one_error_on_every_rank(runs: tuple[Runs, Path]) -> None:
    """Across the ranks (rank 0 a sum, the others a mean), on each rank (a sum, then a mean), a negative weight on one rank."""
    found = runs[0]["kinds"]  # the same text on every rank: the sweep compared them
    assert found["across ranks"]["error"] == (
        "MPIDPStrategy, the window: ranks' training steps returned different kinds of loss (rank 0: a loss sum with a weight, "
        "rank 1: a mean loss, rank 2: a mean loss): every rank returns a 'weight' or none does")
    within = found["within a window"]["error"]
    assert within.startswith("MPIDPStrategy, the window: rank 0: training steps of one window returned a 'weight' (a loss sum) and a mean loss")
    assert within.count("and a mean loss: return one kind") == 3 and "rank 2:" in within, within
    assert found["bad weight"]["error"] == (
        "MPIDPStrategy, the window: rank 2: 'weight' must be a non-negative integer or an integer tensor of one element, got -1")
    assert all(case["untouched"] for case in found.values()), found  # refused before any gradient moved: no step


def test_a_loss_sum_and_its_weight_give_the_global_token_mean_with_uneven_and_empty_ranks(runs: tuple[Runs, Path]) -> None:
    """Rank r scores 1 + r + step of 8 tokens; at several ranks the last scores none. One process's token mean, within float32."""
    done, _ = runs
    for n in (1, 3, 4):
        assert done["sum", n]["steps"] == 2 and done["sum", n]["world"] == n
        assert done["sum", n]["distance"] < 1e-6, (n, done["sum", n])


def test_a_mean_loss_behaves_as_under_ddp(runs: tuple[Runs, Path]) -> None:
    """Against one process (the mean of the ranks' means, clipped) and against DDPStrategy over gloo at 4 ranks."""
    done, _ = runs
    assert done["mean"]["distance"] < 1e-6 and done["mean"]["steps"] == 2
    assert done["manual"]["distance"] < 1e-6 and done["manual"]["steps"] == 3  # manual optimization, a replicated AdamW
    ddp, ours = done["ddp"]["params"], done["mean-params"]["params"]
    assert len(ddp) == len(ours) == 197 and done["ddp"]["steps"] == 2
    assert max(abs(a - b) for a, b in zip(ddp, ours)) <= 2e-5, (ddp, ours)


def test_sharded_turns_adamw_into_the_sharded_one_with_its_groups_and_schedule(runs: tuple[Runs, Path]) -> None:
    found = runs[0]["sharded-optimizer"]
    assert found["False"]["optimizer"] == "AdamW" and found["True"]["optimizer"] == "ShardedAdamW"
    assert found["True"]["weight_decay"] == [0.1, 0.0] and found["True"]["lr"] == found["False"]["lr"] == [0.025, 0.025]  # StepLR halved it
    assert found["state bytes"] == 2 * 4 * 197  # AdamW's two float32 moments, cut across the ranks
    assert found["distance"] < 1e-6


def test_what_cannot_run_is_one_error_on_every_rank(runs: tuple[Runs, Path]) -> None:
    found = runs[0]["refused"]  # the same text on every rank: the sweep compared them
    assert "every rank" in found["rmsprop"] and "RMSprop" in found["rmsprop"]
    assert "find_unused_parameters" in found["ddp option"]
    assert "global norm only" in found["clip by value"]


@pytest.mark.parametrize("n", [1, 4])
def test_collectives_sync_dist_and_the_distributed_sampler(runs: tuple[Runs, Path], n: int) -> None:
    found = runs[0]["collectives", n]
    assert found["world"] == found["sampler"] == n
    assert found["logged"] == found["mean"] == (n - 1) / 2  # self.log(..., sync_dist=True): the mean of the ranks
    assert found["sum"] == [n * (n - 1) // 2, 10 * n * (n - 1) // 2] and found["max"] == [n - 1, 10 * (n - 1)]
    assert found["gathered"] == [[r, 10 * r] for r in range(n)] and found["untouched"]
    assert found["broadcast"] == n - 1 and found["decision"] is True
    assert len(set(found["seen"])) == n and set(found["seen"]) <= set(range(2 * n))  # each rank its own share of the data


def test_model_checkpoint_resumes_at_another_world_size_with_lightning_s_state(runs: tuple[Runs, Path]) -> None:
    """ModelCheckpoint at 4 ranks every epoch; fit(ckpt_path=epoch 0's) at 2 ranks: loops, callback and scheduler go on."""
    done, folder = runs
    saved, resumed = done["save"], done["resume"]
    assert saved["files"] == ["epoch=0.ckpt", "epoch=1.ckpt"] and saved["rank files"] == 4
    assert (saved["epoch"], saved["steps"], saved["batches"], saved["scheduler epoch"]) == (2, 4, 4, 2)
    # resumed after epoch 0 (2 steps, 2 batches seen by the callback, the scheduler stepped once), then 2 epochs more
    assert (resumed["epoch"], resumed["steps"], resumed["batches"], resumed["scheduler epoch"]) == (3, 6, 6, 3)
    assert resumed["lr"] == 0.05 * 0.5**3 and "epoch=2.ckpt" in resumed["files"]
    assert checkpoint.latest(folder / "model-ckpt") is not None


def test_stop_on_signal_stops_every_rank_after_one_step_and_saves(runs: tuple[Runs, Path]) -> None:
    """StopOnSignal at 2 ranks, 4 epochs of one window: the last rank's SIGUSR1 in epoch 1 (as Slurm's --signal through the
    template's trap) stops both ranks after that window, saved; the resumed fit ends with the bits of a run never stopped."""
    done, folder = runs
    found = done["stop"]
    assert (found["stopped"]["steps"], found["stopped"]["saved"], found["rank files"]) == (2, "step-000002", 2)
    assert found["whole"]["steps"] == found["resumed"]["steps"] == 4 and found["whole"]["saved"] is None
    assert found["resumed"]["digest"] == found["whole"]["digest"] != found["stopped"]["digest"]
    assert checkpoint.latest(folder / "stop-ckpt") == folder / "stop-ckpt" / "step-000002" and found["handler"]


def test_validate_and_test_load_a_model_checkpoint_of_another_world_size(runs: tuple[Runs, Path]) -> None:
    """At 2 ranks, into new modules: validate(ckpt_path=epoch 1's) on the resumed fit's Trainer, test(ckpt_path=epoch 0's) on a
    new Trainer; ModelCheckpoint wrote both at 4 ranks. The saving fit's parameters at each epoch's end, and its own validate."""
    done, _ = runs
    saved, resumed = done["save"], done["resume"]
    assert len(set(saved["digests"])) == 2 and saved["digests"][1] == saved["digest"]
    assert resumed["validate"]["digest"] == saved["digests"][1] and resumed["test"]["digest"] == saved["digests"][0]
    assert resumed["validate"]["loss"] == pytest.approx(saved["validate"], rel=1e-6)  # the mean over the ranks of one loss
    assert resumed["test"]["loss"] != resumed["validate"]["loss"]


def test_fabric_strategy_gives_the_token_mean_clips_and_saves(runs: tuple[Runs, Path]) -> None:
    """fabric.backward(loss_sum, weight=n) over uneven ranks, clip_gradients, step; replicated and sharded; save, zero, load."""
    found = runs[0]["fabric"]
    assert found["world"] == 3
    for shard in (False, True):
        assert found[f"distance sharded={shard}"] < 1e-6, found
        assert found[f"loaded sharded={shard}"] == [True, 2, []], found  # the parameters back, "windows" restored in place


def test_fabric_overlap_gives_the_plain_exact_bits_with_no_backward_sync(runs: tuple[Runs, Path]) -> None:
    """MPIDPFabricStrategy(exact=True, overlap="thread") at 3 ranks: fabric.no_backward_sync(model, enabled=...) around each
    window's first micro-batch (no "does not support" warning), the last one's backward reduces on the thread."""
    found = runs[0]["fabric"]
    plain, overlapped = found["overlap=False"], found["overlap=thread"]
    assert plain["mode"] is None and overlapped["mode"] == "thread"
    assert overlapped["digest"] == plain["digest"] and plain["distance"] < 1e-6, found
    assert plain["warned"] == overlapped["warned"] == [], found
