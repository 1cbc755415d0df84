"""The shipped examples run and learn (in-process, on whatever world pytest runs in)."""

from __future__ import annotations

from mpidp.examples import logreg


def test_logreg_learns() -> None:
    loss = logreg.main(["--steps", "60"])
    assert loss < 0.45  # the untrained loss is about 2
