"""The suite's forked workers (tests/forked_workers.py): the gate says when it never fills."""

import pytest

from tests import forked_workers


async def test_a_gate_that_never_fills_fails_the_test_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked_workers, "GATE_TIMEOUT_S", 0.05)
    forked_workers.start_together(2)
    with pytest.raises(AssertionError, match="1 of its workers were never asked for"):
        await forked_workers.start_forked_worker("{}", None)
    with pytest.raises(AssertionError, match="already waiting"):
        forked_workers.start_together(1)  # the unfilled gate stays until the test ends
