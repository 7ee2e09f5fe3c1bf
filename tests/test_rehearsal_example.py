"""The continual-digits example runs in-process (one rank) and rehearsal reduces forgetting."""

from __future__ import annotations

import argparse

import torch
from _scripts import load_script
from mpi4py import MPI


def test_rehearsal_reduces_forgetting_on_digits() -> None:
    mod = load_script("examples/continual_digits.py")
    args = argparse.Namespace(epochs=2, batch=8, lr=0.05, slots=10, candidates=4, representatives=8, seed=0,
                              transport="auto")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny MLP: extra intra-op threads only spin on a shared, loaded machine
    try:
        plain = mod.run(False, args, MPI.COMM_SELF)
        rehearsed = mod.run(True, args, MPI.COMM_SELF)
    finally:
        torch.set_num_threads(threads)
    assert plain[-1, -1] > 0.9  # the last task is learnt either way
    assert plain[-1, :-1].max() < 0.2  # without rehearsal the old tasks are forgotten
    assert rehearsed[-1].mean() > plain[-1].mean() + 0.4
