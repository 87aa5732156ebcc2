"""The sparseloco payload (training/encodings/sparseloco.py): its bytes, its residual kept in
the weights, φ one fragment a round, and a stranger's payload refused when it lies."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_trainer import trainer
from training import checkpoint
from training.algorithms.rounds import start_from_peer
from training.encodings import encoding
from training.encodings.sparseloco import (
    CHUNK,
    FRAGMENTS,
    TOP_K,
    SparseLoCo,
    _pack_lsb_first,
    _unpack_lsb_first,
    pack_bits,
    unpack_bits,
)
from training.models import GPT, preset
from training.settings import OuterConfig, RunSettings
from training.trainer import PayloadRejected, Trainer
from training.worker_config import WorkerConfig

SPARSE = encoding("sparseloco")


@pytest.fixture(params=["numpy", "torch"])
def codec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test under both codecs: the host's NumPy packing (a CPU's) and torch's (a GPU's,
    here on CPU tensors): the same bytes, numbers and refusals."""
    monkeypatch.setattr(SparseLoCo, "torch_codec", request.param == "torch")
    return str(request.param)


def test_bits_pack_and_unpack() -> None:
    values = torch.randint(0, 4, (1001,), generator=torch.Generator().manual_seed(0))
    packed = pack_bits(values, 2)
    assert packed.numel() == -(-1001 * 2 // 8)
    assert torch.equal(unpack_bits(packed, 1001, 2), values)
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]  # LSB first
    # torch's packing (a GPU's): the same bytes, for 2-bit codes and 1-bit masks, any length
    for count in (1, 3, 4, 7, 8, 9, 1001):
        assert torch.equal(_pack_lsb_first(values[:count], 2), pack_bits(values[:count], 2))
        assert torch.equal(_unpack_lsb_first(pack_bits(values[:count], 2), count, 2).long(), values[:count])
        mask = values[:count] > 1
        assert torch.equal(_pack_lsb_first(mask, 1), torch.from_numpy(np.packbits(mask.numpy(), bitorder="little")))


def test_the_torch_codec_gives_numpys_bytes_and_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny payload encoded and decoded both ways: the same wire bytes, the same residual
    and the same decoded tensor, bit for bit."""
    results = []
    for torch_codec in (False, True):
        monkeypatch.setattr(SparseLoCo, "torch_codec", torch_codec)
        a, b = trainer(0, compression="sparseloco"), trainer(1, compression="sparseloco")
        a.inner_steps()
        b.inner_steps()
        wire = a.outer_payload()
        b.outer_payload()
        results.append((wire, a.codec_state["residual"], SPARSE.decode(wire, a._numels, fill=b._sent_flat)))
    (wire_np, residual_np, decoded_np), (wire_t, residual_t, decoded_t) = results
    assert torch.equal(wire_np, wire_t)
    assert torch.equal(residual_np, residual_t)
    assert torch.equal(decoded_np.view(torch.int32), decoded_t.view(torch.int32))


def test_a_tiny_payload_is_under_3_percent_of_float32s() -> None:
    numels = [p.numel() for p in GPT(preset("tiny")).parameters()] * 2
    ratio = SPARSE.nbytes(numels) / encoding("none").nbytes(numels)
    assert ratio <= 0.03, ratio


def test_what_is_left_out_of_delta_stays_in_the_weights() -> None:
    """sent + residual = Δ (each to float32 rounding: one subtraction), the sent part is at
    most TOP_K of each chunk, and after an outer step with a partner θ = φ − residual."""
    t, partner = trainer(0, compression="sparseloco"), trainer(1, compression="sparseloco")
    t.inner_steps()
    partner.inner_steps()
    delta = torch.cat([(p - q).reshape(-1) for p, q in zip(t.phi, t.theta(), strict=True)])
    t.outer_payload()
    sent = torch.cat([d.reshape(-1) for d in t.own_delta()])
    residual = t.codec_state["residual"]
    ulp = 2.0**-23 * float(delta.abs().max())
    assert float((sent + residual - delta).abs().max()) <= ulp
    assert 0 < int((sent != 0).sum()) <= TOP_K * sum(-(-d.numel() // CHUNK) for d in t.phi)
    assert t.apply_noloco(partner.outer_payload())
    after = torch.cat([(p - q).reshape(-1) for p, q in zip(t.phi, t.theta(), strict=True)])
    largest = float(torch.cat([p.reshape(-1) for p in t.phi]).abs().max())
    assert float((after - residual).abs().max()) <= 2.0**-23 * largest  # θ = φ − r, one rounding


def test_a_round_alone_steps_on_the_whole_delta_once() -> None:
    """Alone (no partner, or a refused one), the step takes all of Δ, what the payload left
    out included, and θ restarts from φ: with α = 0, β = 1, φ lands on the trained θ and
    stays there while nothing trains (it overshot by 124% when the residual was kept)."""
    t = trainer(0, compression="sparseloco")
    t.outer = OuterConfig(alpha=0.0, beta=1.0, gamma=0.0)
    t.inner_steps()
    trained = [p.clone() for p in t.theta()]
    for _ in range(4):
        t.outer_payload()
        assert t.apply_noloco(None) is False
        for group in t.optimizer.param_groups:
            group["lr"] = 0.0  # nothing trains from here: Δ is only what is still owed
        t.inner_steps()
    assert "residual" not in t.codec_state
    for p, q in zip(t.phi, trained, strict=True):
        assert float((p - q).abs().max()) <= 2.0**-22 * float(q.abs().max())


def test_the_local_baseline_keeps_its_weights_with_a_sparse_payload() -> None:
    t = trainer(0, compression="sparseloco")
    t.inner_steps()
    trained = [p.clone() for p in t.theta()]
    t.outer_payload()  # made every round (peers may pull it), though local never averages
    t.apply_local()
    assert all(torch.equal(p, q) for p, q in zip(t.theta(), trained, strict=True))


def test_phi_travels_one_fragment_a_round_and_the_rest_is_ours(codec: str) -> None:
    a, b = trainer(0, compression="sparseloco"), trainer(1, compression="sparseloco")
    half = a.payload_numel // 2
    length = -(-half // FRAGMENTS)
    for round_index in range(FRAGMENTS + 1):
        a.inner_steps()
        b.inner_steps()
        a_wire, b_wire = a.outer_payload(), b.outer_payload()
        assert a_wire.numel() == a.payload_nbytes
        seen = torch.cat([p.reshape(-1) for p in b.parse_payload(a_wire).phi])
        own = torch.cat([p.reshape(-1) for p in b._sent.phi])  # type: ignore[union-attr]
        fragment = round_index % FRAGMENTS
        outside = torch.ones(half, dtype=torch.bool)
        outside[fragment * length : (fragment + 1) * length] = False
        assert torch.equal(seen[outside], own[outside])  # b fills in its own φ as it sent it
        a_phi = torch.cat([p.reshape(-1) for p in a.phi])
        inside = ~outside
        assert float((seen[inside] - a_phi[inside]).abs().max()) <= float(a_phi[inside].abs().max()) / 127
        assert a.apply_noloco(b_wire) and b.apply_noloco(a_wire)
    # Always paired: the same slow weights on both sides, as with float32.
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi, strict=True))


def _honest_pair() -> tuple[Trainer, torch.Tensor]:
    a, b = trainer(0, compression="sparseloco"), trainer(1, compression="sparseloco")
    a.inner_steps()
    b.inner_steps()
    a.outer_payload()
    return a, b.outer_payload().clone()


def test_a_bit_set_past_the_last_value_is_refused(codec: str) -> None:
    numels = [5, 5]  # φ of 5 values, Δ of 5: three spare bits in the bitmap's byte
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 0.5, -0.25, 0.125, 2.0, -1.0])
    wire, seen = SPARSE.encode(flat, numels)
    assert seen is not None and torch.equal(SPARSE.decode(wire, numels, fill=seen), seen)
    bitmap_at = 4 + 1 + 4  # fragment, L = 1 code, one scale
    assert wire[bitmap_at] == 0b11111
    wire[bitmap_at] |= 0b100000
    with pytest.raises(ValueError, match="past the last"):
        SPARSE.decode(wire, numels, fill=seen)


def test_a_bitmap_of_all_ones_is_refused_before_its_positions_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the torch codec (a GPU's), a stranger's bitmap with every value marked is refused
    by its count of ones, before ``nonzero`` would list 4× an honest payload's positions in
    the GPU's memory (where running out would end the worker, not refuse the payload)."""
    monkeypatch.setattr(SparseLoCo, "torch_codec", True)
    a, wire = _honest_pair()
    bitmap_at, codes_at, _, _ = _offsets(a)
    half = a.payload_numel // 2
    wire[bitmap_at:codes_at] = 0xFF
    if half % 8:  # no bits past the last value: the count is what must refuse it
        wire[codes_at - 1] = (1 << (half % 8)) - 1

    def listed(*args: object, **kwargs: object) -> None:
        raise AssertionError("the positions were listed before the count was checked")

    monkeypatch.setattr(torch, "nonzero", listed)
    with pytest.raises(PayloadRejected, match="another number"):
        a.parse_payload(wire)


def test_a_bad_payload_before_our_own_is_made_is_refused_not_a_crash() -> None:
    """A compressed outer step needs our payload first (the partner averages it): a program
    error, raised, but only for a payload that passes; a bad one is refused first, as
    before the step was queued ahead of the verdict (a second reader's case)."""
    a, wire = _honest_pair()
    b = trainer(0, compression="sparseloco")  # never made its payload
    b.inner_steps()
    _, _, magnitudes_at, _ = _offsets(a)
    wire[magnitudes_at : magnitudes_at + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    assert b.apply_noloco(wire) is False and b.last_rejection == "payload holds NaN or Inf"
    c = trainer(1, compression="sparseloco")
    c.inner_steps()
    with pytest.raises(RuntimeError, match="outer_payload"):
        c.apply_noloco(_honest_pair()[1])


def _chunk_kept(t: Trainer) -> list[int]:
    sizes = []
    for n in t._numels[len(t._numels) // 2 :]:
        sizes += [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    return [min(TOP_K, c) for c in sizes]


def _offsets(t: Trainer) -> tuple[int, int, int, int]:
    """Byte offsets of the sections after φ: the bitmap, codes, magnitudes, the end."""
    half = t.payload_numel // 2
    length = -(-half // FRAGMENTS)
    chunks = _chunk_kept(t)
    bitmap = 4 + length + 4 * -(-length // 256)
    codes = bitmap + -(-half // 8)
    magnitudes = codes + -(-2 * sum(chunks) // 8)
    return bitmap, codes, magnitudes, magnitudes + 8 * len(chunks)


@pytest.mark.parametrize("damage", ["fragment", "one_more", "moved", "short", "inflated", "nan"])
def test_a_lying_payload_is_refused(damage: str, codec: str) -> None:
    a, wire = _honest_pair()
    a.parse_payload(wire)  # the honest one passes
    bitmap_at, _, magnitudes_at, end = _offsets(a)
    assert end == a.payload_nbytes
    if damage == "fragment":
        wire[:4] = torch.tensor([FRAGMENTS], dtype=torch.int32).view(torch.uint8)
    elif damage in ("one_more", "moved"):
        # The first Δ piece (the token embedding) is whole chunks: chunk 0 keeps TOP_K of CHUNK.
        half = a.payload_numel // 2
        bits = torch.from_numpy(np.unpackbits(wire[bitmap_at:].numpy(), count=half, bitorder="little").copy())
        assert int(bits[:CHUNK].sum()) == TOP_K < CHUNK
        bits[int(torch.nonzero(bits[:CHUNK] == 0)[0])] = 1  # chunk 0 sends one more
        if damage == "moved":  # ... and chunk 1 one fewer: the total is right, the chunks not
            bits[CHUNK + int(torch.nonzero(bits[CHUNK : 2 * CHUNK])[0])] = 0
        packed = torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
        wire[bitmap_at : bitmap_at + len(packed)] = packed
    elif damage == "short":
        wire = wire[:-1]
    elif damage == "inflated":
        magnitudes = wire[magnitudes_at:end].clone().view(torch.float32)
        wire[magnitudes_at:end] = (magnitudes * 1e6).view(torch.uint8)
    else:
        wire[magnitudes_at : magnitudes_at + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(PayloadRejected):
        a.parse_payload(wire)


def test_the_residual_is_in_our_checkpoint_but_not_in_a_joiners_start(tmp_path: Path) -> None:
    a, partner = trainer(0, compression="sparseloco"), trainer(1, compression="sparseloco")
    a.inner_steps()
    partner.inner_steps()
    a.outer_payload()
    assert a.apply_noloco(partner.outer_payload())
    assert bool(a.codec_state["residual"].any())
    tensors, meta = a.state()
    assert torch.equal(tensors["encoding.residual"], a.codec_state["residual"])
    restarted = trainer(0, compression="sparseloco")
    restarted.restore(tensors, meta)
    assert all(torch.equal(x, y) for x, y in zip(restarted.theta(), a.theta(), strict=True))
    # A joiner starts from a peer's state: its φ, not the residual the peer has yet to send.
    path = tmp_path / "peer.ckpt"
    checkpoint.save(path, tensors, meta)
    run = RunSettings(rounds=10, compression="sparseloco")
    joiner = trainer(1, compression="sparseloco")
    start_from_peer(WorkerConfig(run=run, start_from=str(path)), joiner)
    assert joiner.round == a.round and "residual" not in joiner.codec_state
    assert all(torch.equal(x, y) for x, y in zip(joiner.theta(), a.phi, strict=True))


def test_a_chunks_picks_are_its_largest_and_split_in_halves_by_magnitude() -> None:
    """Each chunk sends its k largest magnitudes, in index order, each coded with its sign
    and whether it is in the upper half of the picks by magnitude (against the two halves'
    means): checked against a plain sort of every row."""
    from training.encodings.sparseloco import _select

    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    k = 16
    indices, codes, lower, upper = _select(rows, k)
    for r in range(rows.shape[0]):
        order = torch.argsort(rows[r].abs(), descending=True)
        assert indices[r].tolist() == sorted(order[:k].tolist())
        top = set(order[: k - k // 2].tolist())
        expected = [(int(rows[r, i] < 0) | (int(i in top) << 1)) for i in indices[r].tolist()]
        assert codes[r].tolist() == expected
        assert torch.allclose(upper[r], rows[r, order[: k - k // 2]].abs().mean())
        assert torch.allclose(lower[r], rows[r, order[k - k // 2 : k]].abs().mean())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the torch codec on the device)")
def test_on_cuda_a_payload_decodes_anywhere_to_what_its_sender_used() -> None:
    """A payload encoded on the GPU (selection and packing there), decoded on the CPU and on
    the GPU: exactly the values its sender uses as sent (``seen``), as NoLoCo's pair mean
    needs; and a CPU's payload decoded on the GPU exactly as on the CPU (decoding sums
    nothing). The bytes themselves may differ between devices: on an H200 (2026-11-27) the
    GPU's wire of the same values was not the CPU's, the chunks' magnitudes at least (means
    summed in another order) and some section before them (where top-k picks among ties,
    which random float32s have, is the likely one; not found). A lying count is refused on
    both."""
    numels = [p.numel() for p in GPT(preset("micro")).parameters()] * 2
    flat = torch.randn(sum(numels), generator=torch.Generator().manual_seed(5)) * 1e-2
    wire, seen = SPARSE.encode(flat, numels, round_index=3, state={})
    gpu_wire, gpu_seen = SPARSE.encode(flat.cuda(), numels, round_index=3, state={})
    assert gpu_wire.device.type == "cpu" and gpu_wire.shape == wire.shape
    assert seen is not None and gpu_seen is not None and gpu_seen.device.type == "cuda"
    for fill in (gpu_seen, gpu_seen.cpu()):  # our own φ as sent fills in the rest: here, the sender's
        decoded = SPARSE.decode(gpu_wire, numels, fill=fill)
        assert decoded.device == fill.device
        assert torch.equal(decoded.cpu().view(torch.int32), gpu_seen.cpu().view(torch.int32))
    on_cpu = SPARSE.decode(wire, numels, fill=seen)
    on_gpu = SPARSE.decode(wire.cuda(), numels, fill=seen.cuda())
    assert on_gpu.device.type == "cuda" and torch.equal(on_cpu.view(torch.int32), on_gpu.cpu().view(torch.int32))
    assert torch.equal(on_cpu.view(torch.int32), seen.view(torch.int32))
    half = sum(numels[: len(numels) // 2])
    length = -(-half // FRAGMENTS)
    bitmap_at = 4 + length + 4 * -(-length // 256)
    lying = wire.clone()
    lying[bitmap_at] = 0 if int(wire[bitmap_at]) else 0xFF  # chunk 0's count of ones changes
    with pytest.raises(ValueError, match="another number"):
        SPARSE.decode(lying.cuda(), numels, fill=seen.cuda())
    with pytest.raises(ValueError, match="another number"):
        SPARSE.decode(lying, numels, fill=seen)
