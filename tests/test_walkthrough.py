"""A new user's first hour, as real processes: start a run on your own files, two friends
join, the three train together, then the model comes out and writes text."""

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.test_cli_e2e import SWARMTRAIN, Proc, wait_until_gone
from training import corpus

pytestmark = pytest.mark.e2e
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0"]
# The friends' processes start seconds after the first node's: they join while it still
# trains, take its state and pair or pull from then on. Rounds of ~1 s (micro, 100 steps):
# with rounds of ~0.25 s a node a moment behind its peers stayed alone (docs/training.md).
ROUNDS = 12
STEPS = 100


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "SWARMTRAIN_TEST_MARKER": uuid.uuid4().hex}


async def status_of(data_dir: Path) -> dict[str, Any]:
    done = await trio.run_process([*SWARMTRAIN, "status", "--json", "--data-dir", str(data_dir)], capture_stdout=True)
    status: dict[str, Any] = json.loads(done.stdout)
    return status


async def test_start_a_run_on_your_files_friends_join_train_together_export_and_sample(
    short_tmp: Path, env: dict[str, str]
) -> None:
    texts = short_tmp / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"chapter{i}.txt").write_text(f"Chapter {i}. The swarm trains on what its users bring. " * 120)
    first_dir = short_tmp / "first"
    run_flags = ["--model", "micro", "--rounds", str(ROUNDS), "--inner-steps", str(STEPS), "--metrics-port", "0"]
    log_file = short_tmp / "first.log"
    run_flags += ["--log-file", str(log_file)]
    procs: list[Proc] = []
    try:
        first = await Proc.start(
            ["node", "--data-dir", str(first_dir), *LOOPBACK, "--new-run", "walk", "--data", str(texts), *run_flags],
            env,
        )
        procs.append(first)
        await first.expect("ready in run walk-")
        status = await status_of(first_dir)
        addr = status["addrs"][0]

        friends: list[Proc] = []
        for i in range(2):  # each in procs at once: the second's start may fail
            friends.append(
                await Proc.start(
                    ["join", addr, "--data-dir", str(short_tmp / f"friend{i}"), *LOOPBACK, "--data", str(texts)], env
                )
            )
            procs.append(friends[-1])
        for friend in friends:
            # The join story shows training as it goes, once per round, and where it runs.
            await friend.expect("training: noloco on cpu: round")
            await friend.expect(f"round {ROUNDS} of {ROUNDS}")
        # Each node finishes at its own last round: the first may be a round behind its
        # friends (seen), and its training line comes up to a poll after that.
        await first.expect("training finished")
        await first.expect(f"training: noloco on cpu: round {ROUNDS} of {ROUNDS}")

        status = await status_of(first_dir)
        training = status["training"]
        assert training["finished"] and training["rounds"] == ROUNDS and training["device"] == "cpu", training
        assert training["data_sha256"] == corpus.corpus_sha256(texts)  # the run trains on these files
        assert training["tokens"] > 0 and training["tokens_per_s"] > 0
        for i in range(2):
            friend_training = (await status_of(short_tmp / f"friend{i}"))["training"]
            assert friend_training["finished"], friend_training
            assert friend_training["rounds_with_partner"] >= 1, friends[i].output  # they trained together
        port = int(status["metrics_url"].split(":")[2].split("/")[0])
        scrape = await trio.open_tcp_stream("127.0.0.1", port)
        async with scrape:
            await scrape.send_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            metrics = b""
            while chunk := await scrape.receive_some(65536):
                metrics += chunk
        assert f"swarmtrain_rounds_total {ROUNDS}.0".encode() in metrics and b"swarmtrain_peers " in metrics
        # The node's log (console and --log-file) has the training line once a round.
        logged = log_file.read_text()
        assert f"training: noloco on cpu: round {ROUNDS} of {ROUNDS}" in logged and "finished" in logged
        human = await trio.run_process([*SWARMTRAIN, "status", "--data-dir", str(first_dir)], capture_stdout=True)
        assert f"round {ROUNDS} of {ROUNDS}".encode() in human.stdout

        out = short_tmp / "model"
        exported = await trio.run_process(
            [*SWARMTRAIN, "export", "--data-dir", str(first_dir), "--out", str(out)], capture_stdout=True
        )
        assert b"AutoModelForCausalLM.from_pretrained" in exported.stdout
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
        sampled = await trio.run_process(
            [*SWARMTRAIN, "sample", "--data-dir", str(first_dir), "--prompt", "Chapter", "--tokens", "60"],
            capture_stdout=True,
        )
        assert sampled.stdout.startswith(b"Chapter") and len(sampled.stdout) > 60

        for proc in (*friends, first):
            proc.process.send_signal(signal.SIGINT)
        for proc in (*friends, first):
            assert await proc.finish() == 0, proc.output
            assert "Traceback" not in proc.output
        await wait_until_gone(env["SWARMTRAIN_TEST_MARKER"])
    finally:  # a failed assertion must not leave daemons behind, nor their pipes open
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            for proc in procs:
                if proc.process.poll() is None:
                    proc.process.kill()
                await proc.process.wait()
                if proc.process.stdout is not None:
                    await proc.process.stdout.aclose()
