"""The main job's script, examples/train_lm.py, in a few steps of a tiny model on a corpus of
its own (CPU): every run writes its curves and learns, under bf16 autocast too, and
tensor parallelism over two gloo processes follows one process."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "30", "--log-every", "10", "--batch", "8", "--seq", "32", "--dim", "32", "--layers", "1",
        "--heads", "2", "--device", "cpu"]


def _corpus(directory: Path) -> Path:
    lines = [f"cookie {i}: a fortune {'told' if i % 3 else 'kept'} is a fortune {'shared' if i % 2 else 'saved'}."
             for i in range(400)]
    path = directory / "corpus.txt"
    path.write_text("\n%\n".join(lines), encoding="utf-8")
    return path


def _train(tmp_path: Path, *extra: str):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--data", str(_corpus(tmp_path)),
               "--out", str(out), *TINY, *extra]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    return done, out


def _final_rows(out: Path, tp: int):
    with open(out / f"loss_tp{tp}.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert (out / f"loss_tp{tp}.png").stat().st_size > 0
    return {r["optimizer"]: r for r in rows if r["step"] == "30"}


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_both_optimizers_learn_and_write_their_curves(tmp_path, amp):
    done, out = _train(tmp_path, "--amp", amp)
    assert done.returncode == 0, done.stderr[-2000:]
    finals = _final_rows(out, 1)
    assert set(finals) == {"muon", "adamw"}
    vocab = len(set(_corpus(tmp_path).read_text()))
    for row in finals.values():  # from ln(vocab) nats a character at the start
        assert float(row["val_loss"]) < math.log(vocab) - 0.5, row


def test_float16_without_a_gpu_is_refused_by_name(tmp_path):
    done, _ = _train(tmp_path, "--amp", "fp16")
    assert done.returncode == 2 and "--amp fp16 needs a GPU" in done.stderr


def test_tensor_parallel_over_two_processes_follows_one(tmp_path):
    done, out = _train(tmp_path, "--optimizers", "muon")
    assert done.returncode == 0, done.stderr[-2000:]
    done, _ = _train(tmp_path, "--optimizers", "muon", "--tp", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    one, two = _final_rows(out, 1)["muon"], _final_rows(out, 2)["muon"]
    assert abs(float(one["val_loss"]) - float(two["val_loss"])) < 1e-3, (one, two)
