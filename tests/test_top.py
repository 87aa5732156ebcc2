"""``swarmtrain top``: the rows it shows, the data dirs it finds, and a real node's table."""

import sys
from pathlib import Path

import pytest
import trio
from rich.console import Console

from node.api import SOCKET_NAME
from node.top import COLUMNS, data_dirs, row, table
from tests.adversarial.harness import finished, micro_noloco, start_trainers, until
from tests.conftest import open_swarm

TRAINING = {
    "peer_id": "12D3KooWRQR6dEJXaYFpJcVNJ2gCWNScK5th5Cp4oFTyJnM2bvKx",
    "run_id": "demo-1a2b3c",
    "peers_seen": 3,
    "reachability": "public",
    "training": {
        "algorithm": "noloco",
        "rounds": 4,
        "rounds_total": 20,
        "final_loss": 2.25,
        "tokens_per_s": 1234.5,
        "eta_s": 125.0,
        "rounds_with_partner": 3,
        "loss_curve": [[0, 3.0]] * 4,
        "device": "cpu",
        "bytes_sent": 12_000_000,
        "bytes_received": 11_000_000,
        "finished": False,
    },
}


def test_a_row_says_where_a_node_is_and_a_silent_one_says_so() -> None:
    cells = dict(zip(COLUMNS, row("n0", TRAINING), strict=True))
    assert cells["node"] == "JnM2bvKx"  # the tail of the peer id, as in the logs
    assert (cells["round"], cells["val loss"], cells["tokens/s"], cells["left"]) == (
        "4/20",
        "2.250",
        "1,234",
        "2 min 05 s",
    )
    assert (cells["partner"], cells["peers"], cells["device"], cells["sent"]) == ("3/4", "3", "cpu", "12.0 MB")
    assert row("n1", None)[:2] == ["n1", "(not answering)"]
    idle = dict(zip(COLUMNS, row("n2", {**TRAINING, "training": None, "not_training": "other data"}), strict=True))
    assert idle["round"] == "not training" and idle["peers"] == "3"
    console = Console(record=True, width=200)
    console.print(table([row("n0", TRAINING), row("n1", None)]))
    text = console.export_text()
    assert all(column in text for column in COLUMNS) and "(not answering)" in text


def test_a_run_until_stopped_shows_no_end_and_the_loss_says_which_it_is() -> None:
    from node.progress import training_lines

    open_ended = {**TRAINING["training"], "rounds_total": None, "eta_s": None, "full_val_loss": None}
    cells = dict(zip(COLUMNS, row("n0", {**TRAINING, "training": open_ended}), strict=True))
    assert (cells["round"], cells["left"]) == ("4/∞", "-")
    head = "noloco on cpu: round 4 (until stopped), validation loss 2.250, 1,234 tokens/s"
    assert training_lines(open_ended)[0] == head
    done = {**TRAINING["training"], "finished": True, "full_val_loss": 2.125}
    head = "noloco on cpu: round 4 of 20, validation loss 2.250 (full validation 2.125), 1,234 tokens/s, finished"
    assert training_lines(done)[0] == head


def test_a_status_holds_512_points_of_a_curve_however_long_the_run() -> None:
    """A run until its nodes stop has no last round: a status carries at most 512 points of
    each curve, evenly spread, first and last kept, and its count of rounds apart. The whole
    curve passed the control API's frame bound after ~127k rounds; here 10× that."""
    import msgpack

    from node.algorithms.base import STATUS_CURVE_POINTS, thinned
    from node.api import MAX_FRAME_NBYTES
    from node.progress import training_lines

    curve = [[float(10 * r), 2.0 + 1.0 / (r + 1)] for r in range(1_300_000)]
    shown = thinned(curve)
    assert len(shown) == STATUS_CURVE_POINTS == 512 and shown[0] == curve[0] and shown[-1] == curve[-1]
    assert [p[0] for p in shown] == sorted({p[0] for p in shown})  # in order, none twice
    assert thinned(curve[:512]) == curve[:512]
    training = {**TRAINING["training"], "loss_curve": shown, "outer_s_rounds": thinned(curve)}
    training["rounds_trained_here"] = len(curve)
    assert len(msgpack.packb({"training": training})) < MAX_FRAME_NBYTES // 100
    assert "a partner in 3 of 1300000 rounds" in training_lines(training)[1]


def test_a_folder_of_nodes_is_expanded_to_their_data_dirs(tmp_path: Path) -> None:
    for name in ("boot", "n0", "n1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / SOCKET_NAME).touch()
    (tmp_path / "forkserver.log").touch()
    assert data_dirs([tmp_path]) == [tmp_path / "boot", tmp_path / "n0", tmp_path / "n1"]
    assert data_dirs([tmp_path / "n0"]) == [tmp_path / "n0"]
    assert data_dirs([tmp_path / "missing"]) == [tmp_path / "missing"]  # shown as not answering


@pytest.mark.integration
async def test_top_once_shows_a_running_nodes_training(short_tmp: Path) -> None:
    training = micro_noloco(2)
    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 2, training, run_name="top")
        await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=240)
        done = await trio.run_process(
            [sys.executable, "-m", "node", "top", "--once", str(short_tmp)], capture_stdout=True
        )
        text = done.stdout.decode()
        for node in nodes:
            assert node.peer_id[-8:] in text
        assert text.count("2/2") >= 2 and "done" in text and "(not answering)" not in text


def test_a_download_and_a_replay_show_as_bars_and_reprint_each_tenth() -> None:
    from node.progress import _round_of, training_lines

    fetching = {**TRAINING["training"], "download": [600_000_000, 1_200_000_000]}
    lines = training_lines(fetching)
    assert "fetching a peer's state [##########..........] 50% of 1,200.0 MB" in lines
    replaying = {**TRAINING["training"], "replay": [9, 10]}
    assert "replaying the log [##################..] 90% of 10 rounds" in training_lines(replaying)
    a_bit_more = {**fetching, "download": [610_000_000, 1_200_000_000]}
    a_tenth_more = {**fetching, "download": [720_000_000, 1_200_000_000]}
    assert _round_of(a_bit_more) == _round_of(fetching) != _round_of(a_tenth_more)


def test_the_join_story_goes_on_without_a_word_once_its_reader_is_gone() -> None:
    """``swarmtrain join … | head``: after the reader left, the next line must not end the
    node with a BrokenPipeError (a second reader's point, from the code)."""
    import subprocess
    import sys

    script = "from node.progress import _say\nfor i in range(200): _say('x' * 1000)\nprint('went on', file=sys.stderr)"
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\n" + script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # the reader is gone before the first line
    err = child.stderr.read()
    child.stderr.close()
    assert child.wait(timeout=60) == 0, err
    assert b"went on" in err and b"BrokenPipeError" not in err
