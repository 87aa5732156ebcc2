"""Arbitrary bytes into every decoder give a clean refusal, never a crash: a CI-sized fuzz run.

The decoders, their valid seeds and the mutations are bench/fuzz_targets.py's, shared with
the bench (bench/fuzz.py: 10 000 inputs each, coverage-guided when atheris is installed).
Here each gets a few hundred seeded inputs, the same ones on every run (but for the order
of map entries inside CRDT updates, which yrs writes from a hash map), in this process,
except the targets that hand bytes to native readers (pycrdt, safetensors): a segfault there
cannot be caught, so they run in child processes and a dead child fails the test instead of
ending the test run.
"""

import json

import pytest

from bench import fuzz_targets

NUM_INPUTS = 300
SEED = 0
# Crashes the fuzzer found that are not fixed yet (issue 12): strict, so a fix makes the
# test fail until its entry here is removed.
KNOWN_CRASHES: dict[str, str] = {}


def _cases() -> list[object]:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_CRASHES[name]))
        if name in KNOWN_CRASHES
        else name
        for name in fuzz_targets.TARGETS
    ]


@pytest.mark.parametrize("name", _cases())
def test_mutated_and_random_inputs_are_refused_cleanly(name: str) -> None:
    report = fuzz_targets.fuzz(fuzz_targets.TARGETS[name], NUM_INPUTS, SEED)
    assert report.inputs == NUM_INPUTS
    assert report.crashes == 0, json.dumps(report.crash_examples, indent=1)[:8000]
    # The seeds are valid and some mutants still are: the inputs reach past the first check.
    assert report.accepted > 0 and report.refused > 0


def test_every_target_has_a_seed_its_decoder_accepts() -> None:
    for target in fuzz_targets.TARGETS.values():
        verdicts = [fuzz_targets.run_one(target, seed).kind for seed in target.seeds()]
        assert "crash" not in verdicts, target.name
        assert "accepted" in verdicts, target.name


def test_inputs_are_the_same_on_every_run() -> None:
    target = fuzz_targets.TARGETS["wire_decode"]
    first = fuzz_targets.Inputs(target, SEED)
    second = fuzz_targets.Inputs(target, SEED)
    assert [next(first) for _ in range(200)] == [next(second) for _ in range(200)]
