"""Fuzz every decoder of bytes from a peer (or the worker pipe) and print one JSON verdict.

    .venv/bin/python bench/fuzz.py [--per-decoder N] [--seed S] [--only NAME[,NAME]]
                                   [--mode auto|atheris|mutation] [--jobs J]

The targets, their seeds and the mutation engine are in bench/fuzz_targets.py (the CI test
tests/test_fuzz_decoders.py runs the same ones, a few hundred inputs each). Here each
decoder runs in a worker process of its own, ``--jobs`` at a time:

- ``atheris`` (when ``import atheris`` works; it is not a dependency of the project): the
  worker imports protocol/ and training/ under atheris' instrumentation and libFuzzer
  drives it for exactly N runs (``-runs=N``), coverage-guided, mutating with both
  libFuzzer's mutators and ours (msgpack-aware edits, length fields, splices of seeds);
- ``mutation``: our mutation loop alone (seeded, deterministic); the CRDT targets run in
  child processes per batch there (pycrdt can segfault).

A worker writes, before each input, the input it is about to run; if it dies (a native
crash, libFuzzer's out-of-memory or per-input timeout, or no progress for ``STALL_S``), that
input is reported as a crash and a new worker goes on with the runs left. Progress goes to
stderr; the result is one JSON object on stdout:

    {"decoders": {name: {inputs, accepted, refused, crashes, seconds, mode}},
     "total_inputs": ..., "crashes": [{decoder, exception, input_hex, traceback}, ...]}
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # bench.fuzz_targets, imported only once the mode is known

if TYPE_CHECKING:
    from bench.fuzz_targets import Report

# Our modules, instrumented for coverage under atheris (libraries are not: we fuzz our code).
INSTRUMENTED = ("protocol", "training")
# A worker that reports no new input for this long is hanging on the one it runs.
STALL_S = 180.0
# libFuzzer's own limits: one input running longer, or the worker growing past this, is a crash.
INPUT_TIMEOUT_S = 60
RSS_LIMIT_MB = 4096
# Of the mutants under atheris, libFuzzer's (byte-level, coverage-driven); ours make the
# rest (msgpack-aware edits with lengths, hashes and signatures fixed up reach deeper).
LIBFUZZER_SHARE = 0.35
# A decoder whose worker keeps dying is given up after this many new workers.
MAX_RESTARTS = 20
# A worker writes its counts after this many inputs (and after every crash).
COUNTS_EVERY = 64
# Crash descriptions in the output (every crash is counted per decoder).
MAX_CRASHES_SHOWN = 20
PROGRESS_EVERY_S = 15.0


def atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


# --- the worker: one decoder, one process ---


class _Ledger:
    """What the parent reads if this worker dies: the input under way and the counts so far.
    No "current" file means no input ever ran: the worker failed to start (a harness error)."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._current: int | None = None
        self._inputs_written = -COUNTS_EVERY
        self._crashes_written = 0

    def before(self, data: bytes) -> None:
        if self._current is None:
            self._current = os.open(self._workdir / "current", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._current, 0)
        os.pwrite(self._current, data, 0)

    def after(self, report: "Report") -> None:
        crashed = report.crashes != self._crashes_written
        if report.inputs - self._inputs_written < COUNTS_EVERY and not crashed:
            return  # inputs not counted when the worker dies are run again by the next one
        self._inputs_written = report.inputs
        _write_json(self._workdir / "counts.json", report.summary())
        if crashed:
            self._crashes_written = report.crashes
            _write_json(self._workdir / "crashes.json", report.crash_examples)

    def finish(self, report: "Report") -> None:
        _write_json(self._workdir / "crashes.json", report.crash_examples)
        _write_json(self._workdir / "done.json", report.summary())


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _mutation_worker(name: str, runs: int, seed: int, workdir: Path) -> None:
    from bench import fuzz_targets

    ledger = _Ledger(workdir)
    report = fuzz_targets.fuzz(fuzz_targets.TARGETS[name], runs, seed, before=ledger.before, after=ledger.after)
    ledger.finish(report)


def _atheris_worker(name: str, runs: int, seed: int, workdir: Path) -> None:
    import atheris

    with atheris.instrument_imports(include=list(INSTRUMENTED)):
        from bench import fuzz_targets

    target = fuzz_targets.TARGETS[name]
    inputs = fuzz_targets.Inputs(target, seed)
    corpus_dir = workdir / "corpus"
    corpus_dir.mkdir(exist_ok=True)
    for i, data in enumerate(inputs.seeds):
        (corpus_dir / f"seed-{i}").write_bytes(data)
    report = fuzz_targets.Report(name, "atheris")
    ledger = _Ledger(workdir)
    start = time.perf_counter()

    def test_one(data: bytes) -> None:
        ledger.before(data)
        verdict = fuzz_targets.run_one(target, data)
        report.count(verdict)
        inputs.note(data, verdict)
        report.seconds = time.perf_counter() - start
        if report.inputs >= runs:
            ledger.finish(report)
        else:
            ledger.after(report)

    def mutate(data: bytes, max_size: int, mutation_seed: int) -> bytes:
        rng = random.Random(mutation_seed)
        roll = rng.random()
        if roll < LIBFUZZER_SHARE:
            mutated: bytes = atheris.Mutate(data, max_size)
            return mutated
        # Half of ours start again from a seed or an accepted input, not libFuzzer's pick
        # (which is often an invalid input that reached a new error path).
        base = data if roll < (1 + LIBFUZZER_SHARE) / 2 else rng.choice(inputs.corpus)
        return inputs.mutate(base, rng)[:max_size]

    argv = [
        sys.argv[0],
        f"-runs={runs}",
        f"-seed={seed + 1}",  # 0 would mean "pick one"
        f"-max_len={inputs.max_len}",
        f"-timeout={INPUT_TIMEOUT_S}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        f"-artifact_prefix={workdir}/",
        "-print_final_stats=1",
        str(corpus_dir),
    ]
    if target.tokens:
        dictionary = workdir / "tokens.dict"
        dictionary.write_text("".join(f'"{_escape(token)}"\n' for token in target.tokens))
        argv.insert(-1, f"-dict={dictionary}")
    atheris.Setup(argv, test_one, custom_mutator=mutate)
    atheris.Fuzz()


def _escape(token: bytes) -> str:
    """A token as libFuzzer's dictionary format spells it."""
    return "".join(f"\\x{b:02x}" for b in token)


# --- the parent: workers per decoder, restarts, the summary ---


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _log(message: str) -> None:
    print(f"[fuzz {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class HarnessError(Exception):
    """A worker died before running any input: our bug, not a decoder's."""


def fuzz_decoder(name: str, runs: int, seed: int, mode: str, workdir: Path) -> "Report":
    """All ``runs`` inputs of one decoder, through as many workers as it takes."""
    from bench.fuzz_targets import Report, Verdict

    total = Report(name, mode)
    attempt = 0
    while total.inputs < runs and attempt <= MAX_RESTARTS:
        part_dir = workdir / f"{name}-{attempt}"
        part_dir.mkdir(parents=True)
        left = runs - total.inputs
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--mode", mode]
        command += ["--per-decoder", str(left), "--seed", str(seed + attempt), "--workdir", str(part_dir)]
        started = time.monotonic()
        with (
            open(part_dir / "worker.log", "wb") as log,
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT) as worker,
        ):
            died = _watch(worker, name, part_dir, left)
        counts = _read_json(part_dir / "done.json", None) or _read_json(part_dir / "counts.json", {})
        total.merge(counts, _read_json(part_dir / "crashes.json", []))
        total.seconds += time.monotonic() - started
        if died is None and not (part_dir / "done.json").exists():
            died = f"exit status {worker.returncode} before its last input"
        if died is not None:
            current = part_dir / "current"
            log_tail = (part_dir / "worker.log").read_bytes()[-3000:].decode(errors="replace")
            if not current.exists():
                raise HarnessError(f"the {name} worker died before its first input ({died}):\n{log_tail}")
            crash = {
                "decoder": name,
                "exception": f"worker died ({died}) on this input",
                "signature": f"worker died: {died.split(' ')[0]}",
                "input_hex": current.read_bytes().hex(),
                "traceback": log_tail,
            }
            total.count(Verdict("crash", crash))
            _log(f"{name}: worker died ({died}); {runs - total.inputs} inputs left")
        attempt += 1
    return total


def _watch(worker: "subprocess.Popen[bytes]", name: str, part_dir: Path, runs: int) -> str | None:
    """Wait for a worker, printing progress; how it died, or None if it exited cleanly."""
    last_inputs, last_change, last_print = -1, time.monotonic(), time.monotonic()
    while True:
        try:
            returncode = worker.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        counts = _read_json(part_dir / "counts.json", {})
        now = time.monotonic()
        if counts.get("inputs", 0) != last_inputs:
            last_inputs, last_change = counts.get("inputs", 0), now
        elif now - last_change > STALL_S:
            worker.kill()
            worker.wait()
            return f"hang: no progress for {STALL_S:.0f} s"
        if now - last_print > PROGRESS_EVERY_S:
            last_print = now
            _log(f"{name}: {counts.get('inputs', 0)}/{runs} inputs, {counts.get('crashes', 0)} crashes")
    if returncode == 0:
        return None
    if returncode < 0:
        return f"signal {-returncode}"
    tail = (part_dir / "worker.log").read_bytes()[-4000:]
    for kind in (b"out-of-memory", b"timeout", b"deadly signal"):
        if kind in tail:
            return f"libFuzzer {kind.decode()} (exit status {returncode})"
    return f"exit status {returncode}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-decoder", type=int, default=10_000, metavar="N", help="inputs per decoder")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="these decoders only (see --list)")
    parser.add_argument("--mode", choices=("auto", "atheris", "mutation"), default="auto")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="decoders fuzzed at once")
    parser.add_argument("--list", action="store_true", help="print the decoders and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.per_decoder < 1 or args.jobs < 1:
        parser.error("--per-decoder and --jobs must be >= 1")

    if args.worker:
        run_worker = _atheris_worker if args.mode == "atheris" else _mutation_worker
        run_worker(args.worker, args.per_decoder, args.seed, args.workdir)
        return

    from bench.fuzz_targets import TARGETS

    if args.list:
        for target in TARGETS.values():
            print(f"{target.name:28s} {target.what}")
        return
    names = list(TARGETS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown decoders {unknown}; known: {', '.join(TARGETS)}")
    if args.mode == "atheris" and not atheris_available():
        parser.error("--mode atheris: atheris is not installed (pip install atheris)")
    use_atheris = args.mode == "atheris" or (args.mode == "auto" and atheris_available())
    modes = {n: "atheris" if use_atheris and (TARGETS[n].ours or args.mode == "atheris") else "mutation" for n in names}
    _log(f"{len(names)} decoders × {args.per_decoder} inputs, {args.jobs} at a time, atheris: {use_atheris}")

    start = time.monotonic()
    reports: dict[str, Report] = {}
    errors: dict[str, str] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="swarmtrain-fuzz-") as tmp:

        def one(name: str) -> None:
            try:
                report = fuzz_decoder(name, args.per_decoder, args.seed, modes[name], Path(tmp))
            except HarnessError as exc:
                _log(str(exc))
                with lock:
                    errors[name] = str(exc)
                return
            with lock:
                reports[name] = report
            _log(f"{name}: done, {report.summary()}")

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in [pool.submit(one, name) for name in names]:
                future.result()

    done = [name for name in names if name in reports]
    crashes = [example for name in done for example in reports[name].crash_examples]
    result: dict[str, Any] = {
        "decoders": {name: reports[name].summary() for name in done},
        "total_inputs": sum(r.inputs for r in reports.values()),
        "total_crashes": sum(r.crashes for r in reports.values()),
        "wall_seconds": round(time.monotonic() - start, 1),
        "crashes": [{k: v for k, v in c.items() if k != "signature"} for c in crashes[:MAX_CRASHES_SHOWN]],
    }
    if errors:
        result["harness_errors"] = errors
    print(json.dumps(result, indent=1))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
