"""SparseLoCo-style payloads (issue 16; arXiv 2508.15706): Δ as the top-k of each chunk
in 2-bit values, what is left out kept in the local weights; φ one fragment a round, in
int8. About 1% of float32's bytes.

**Δ** (the outer gradient, φ − θ). Every piece (one parameter's Δ) is cut into chunks of
``CHUNK`` values, and each chunk keeps its ``TOP_K`` largest magnitudes (all of a chunk
smaller than that). Each kept value travels as 2 bits: its sign, and whether it is in the
upper half of the chunk's kept magnitudes; each chunk carries two float32 magnitudes, the
means of its lower and its upper half. What was not sent, the residual r = Δ − sent
(``state["residual"]``), is error feedback kept *in the weights*: after an outer step
with a partner the trainer restarts from θ ← φ − r instead of θ ← φ (training/trainer.py),
so next round's Δ = φ − θ holds it again and nothing a node learned is lost, only sent
later. A round without a partner steps on the whole Δ, r included, and drops r. (Feedback
kept beside the weights, with θ ← φ, measured far worse: two nodes of a 34k-parameter
model, 20 rounds of 10 steps, validation loss 3.05 against 2.17 with float32 payloads;
kept in θ, 2.20; /tmp-style probe in docs/training.md.) The residual is in the checkpoint
(``encoding.residual``), not in a state given to a joiner.

**φ** (the slow weights, for NoLoCo's γ term). φ_i − φ_j is what NoLoCo needs of a
partner's φ, and it is not sparse, so φ travels whole but one fragment at a time: the
concatenated φ (N values) is cut into ``FRAGMENTS`` fragments of L = ⌈N / FRAGMENTS⌉, and
a round's payload holds fragment ``round mod FRAGMENTS`` in blockwise int8
(training/quantize.py). A receiver knows the partner's φ on that fragment only, and uses
its own φ *as it sent it* everywhere else (``decode``'s ``fill``), so the γ term pulls
the fragment and is zero elsewhere: each value is pulled once every ``FRAGMENTS`` rounds.
Both sides of a pair use, for each side, the same numbers (what was sent), so the pair's
mean is still preserved exactly (training/noloco.py).

Layout, version 1 (little-endian), for pieces n_1..n_2Q (each parameter's φ, then each
one's Δ, as training/trainer.py lays out a payload; M = Σ of the Δ pieces):

    fragment   uint32: the fragment index f (< FRAGMENTS)
    φ codes    L int8: φ[f·L : (f+1)·L] quantized (zero past N)
    φ scales   ⌈L / 256⌉ float32: the codes' block scales
    kept       ⌈M / 8⌉ bytes: a bitmap over the concatenated Δ, LSB first, 1 where a value
               is sent; a chunk of c values has exactly min(TOP_K, c) ones, the bits past
               M are zero
    codes      ⌈2·K / 8⌉ bytes: per sent value, in the bitmap's order, 2 bits LSB first:
               bit 0 its sign (1: negative), bit 1 upper half (1) or lower (0)
    magnitudes 2 float32 per chunk, chunks in order (piece by piece): the lower half's
               mean, the upper half's

where K = Σ min(TOP_K, c) over the chunks. Every size follows from the pieces' sizes, so
the payload's size is fixed for a run (the outbox and the pairing check rely on it). A
decoder refuses (ValueError) a fragment index out of range, a chunk with another count
of ones, a bit set past M; magnitudes and scales come out as they are, and the caller
refuses non-finite values and checks the result against its bounds like any payload.

Why these numbers (`swarmtrain simulate --nodes 4 --rounds 30 --compression C --set
seed=1`, tiny, 2 cores; final loss over float32's 2.000): a chunk keeping 64 of 4096
(1.6%) lost 8.9%, 256 lost 6.0%, 1024 (25%) 1.1%, all 4096 in 2 bits 0.4%: what costs
quality is how few values go, not their 2 bits nor φ's fragments. At 25% a bitmap (1 bit
a value) is cheaper than 12-bit indices (3 bits a value); φ in 32 fragments keeps the
whole at ~2.8% of float32's bytes.
"""

from typing import Any

import numpy as np
import torch

from training.encodings import topk
from training.encodings.topk import CHUNK, TOP_K
from training.quantize import BLOCK, dequantize, quantize

VERSION = 1
FRAGMENTS = 32


def _chunks(numels: list[int]) -> list[int]:
    """Every Δ chunk's size, piece by piece."""
    sizes = []
    for n in numels[len(numels) // 2 :]:
        sizes += [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    return sizes


def _fragment_len(numels: list[int]) -> int:
    return -(-sum(numels[: len(numels) // 2]) // FRAGMENTS)


def _layout(numels: list[int]) -> tuple[int, int, list[int], int]:
    """(L, the φ section's bytes, the chunks' sizes, K)."""
    if len(numels) % 2:
        raise ValueError("a payload is φ then Δ: an even number of pieces")
    length = _fragment_len(numels)
    chunks = _chunks(numels)
    kept = sum(min(TOP_K, c) for c in chunks)
    return length, length + 4 * -(-length // BLOCK), chunks, kept


def magnitudes_nbytes(numels: list[int]) -> int:
    """The last section's bytes (the chunks' magnitudes): where bench/attacks.py inflates."""
    return 8 * len(_chunks(numels))


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative ints < 2**bits → ⌈len·bits / 8⌉ bytes, LSB first."""
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((values.cpu().to(torch.int64)[:, None] >> shifts) & 1).reshape(-1).to(torch.uint8)
    return torch.from_numpy(np.packbits(stream.numpy(), bitorder="little"))


def unpack_bits(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: ``count`` ints of ``bits`` bits each (int64)."""
    stream = torch.from_numpy(np.unpackbits(data.numpy(), count=count * bits, bitorder="little"))
    return (stream.view(count, bits).to(torch.int64) << torch.arange(bits, dtype=torch.int64)).sum(dim=1)


def _pack_lsb_first(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_bits`` where the values are (a GPU): the same bytes, without moving the
    unpacked stream to the host. Each byte holds 8 // bits values, the first in its lowest
    bits."""
    per_byte = 8 // bits
    padded = torch.nn.functional.pad(values.to(torch.int32), (0, (-values.numel()) % per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=values.device)
    return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8).cpu()


def _unpack_lsb_first(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The inverse, where ``data`` is: ``count`` values of ``bits`` bits (uint8)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
    return ((data[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]


_POPCOUNT = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.int32)
"""Ones in each byte value."""
_POPCOUNT_ON: dict[torch.device, torch.Tensor] = {}
"""``_POPCOUNT`` on each device it was needed on (a copy there each decode would wait for
the stream: the payload's copy queued before it)."""


def _popcount_on(device: torch.device) -> torch.Tensor:
    if device not in _POPCOUNT_ON:
        _POPCOUNT_ON[device] = _POPCOUNT.to(device)
    return _POPCOUNT_ON[device]


def _decode_delta_on(data: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """training/encodings/topk.py ``decode`` with torch where ``data`` is (a GPU's memory):
    (positions of the sent values, ascending; their float32 values), the same numbers, and
    the same refusals (``ValueError``) of a bit set past the last value or a chunk with
    another count of ones, decided with two reads from the device. Every size follows from
    ``chunks`` (the run's pieces), none from the bytes: the positions found are ``kept``."""
    total, kept = sum(chunks), topk.num_kept(chunks)
    if data.dtype != torch.uint8 or data.numel() != topk.nbytes(chunks):
        raise ValueError(f"these chunks' sparse values are {topk.nbytes(chunks)} bytes, got {data.numel()}")
    mask_end = -(-total // 8)
    codes_end = mask_end + -(-2 * kept // 8)
    if mask_end == 0:
        return torch.zeros(0, dtype=torch.int64, device=data.device), torch.zeros(0, device=data.device)
    # First the bitmap's count of ones, from a byte table: a stranger's bitmap of all ones
    # would make the positions below 4× an honest payload's (8 bytes a value sent), in the
    # GPU's memory, where running out ends the worker.
    bitmap = data[:mask_end]
    ones = torch.index_select(_popcount_on(data.device), 0, bitmap.int()).sum()
    # Bits past the last value, in the last byte (none to look at when it is full: a shift
    # by the width is not done, its result differs between devices).
    used = total - 8 * (mask_end - 1)
    past_bits = (bitmap[-1] >> used) != 0 if used < 8 else torch.zeros((), dtype=torch.bool, device=data.device)
    past, count = torch.stack([past_bits.long(), ones.long()]).tolist()
    if past:
        raise ValueError("bits set past the last value")
    if count != kept:
        raise ValueError("a chunk sends another number of values than its share")
    mask = _unpack_lsb_first(bitmap, total, 1)
    codes = _unpack_lsb_first(data[mask_end:codes_end], kept, 2)
    magnitudes = data[codes_end:].clone().view(torch.float32)  # a copy: aligned for the view
    sizes = torch.tensor(chunks, dtype=torch.int64)
    per_chunk = torch.clamp(sizes, max=TOP_K).to(data.device)
    found = torch.nonzero(mask).view(-1)  # ascending, chunk by chunk: exactly ``kept`` of them
    ends = torch.searchsorted(found, torch.cumsum(sizes, 0).to(data.device))
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    if not bool((counts == per_chunk).all()):
        raise ValueError("a chunk sends another number of values than its share")
    # Each value's magnitude: its chunk's lower (code bit 1 clear) or upper mean; its sign, bit 0.
    which = torch.repeat_interleave(2 * torch.arange(len(chunks), device=data.device), per_chunk) + (codes >> 1)
    sign = 1.0 - 2.0 * (codes & 1).to(torch.float32)
    return found, magnitudes[which] * sign


def _select(chunk_values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks (m, c) → (indices (m, k) ascending, codes (m, k), lower and upper magnitudes (m,))."""
    # The upper half of the picks by magnitude: a second, smaller top-k (where magnitudes
    # tie across the halves' border, either split gives the same two means).
    picked_magnitudes, picked = torch.topk(chunk_values.abs(), k, dim=1, sorted=False)
    half = k // 2
    _, tops = torch.topk(picked_magnitudes, k - half, dim=1, sorted=False)
    is_upper = torch.zeros_like(picked, dtype=torch.bool).scatter_(1, tops, True)
    indices, order = torch.sort(picked, dim=1)  # in index order, as the bitmap lists them
    values = torch.gather(chunk_values, 1, indices)
    magnitudes = values.abs()
    upper = torch.gather(is_upper, 1, order)
    lower_mean = (magnitudes * ~upper).sum(dim=1) / max(half, 1)
    upper_mean = (magnitudes * upper).sum(dim=1) / (k - half)
    codes = (values < 0).to(torch.int64) | (upper.to(torch.int64) << 1)
    return indices, codes, lower_mean, upper_mean


def _values(codes: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """2-bit codes (m, k) and their chunks' magnitudes (m,) → float32 values (m, k)."""
    magnitude = torch.where((codes >> 1).bool(), upper[:, None], lower[:, None])
    return torch.where((codes & 1).bool(), -magnitude, magnitude)


class SparseLoCo:
    name = "sparseloco"
    lossy = True

    def nbytes(self, numels: list[int]) -> int:
        _, phi_nbytes, chunks, kept = _layout(numels)
        return 4 + phi_nbytes + -(-sum(chunks) // 8) + -(-2 * kept // 8) + 8 * len(chunks)

    def encode(
        self, flat: torch.Tensor, numels: list[int], *, round_index: int = 0, state: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        flat = flat.to(torch.float32)
        half = sum(numels[: len(numels) // 2])
        phi, delta = flat[:half], flat[half:]
        state = {} if state is None else state
        v = delta  # what was not sent before is still in θ, so Δ = φ − θ holds it
        length, _, _, _ = _layout(numels)
        fragment = round_index % FRAGMENTS
        piece = phi[fragment * length : (fragment + 1) * length]
        piece = torch.nn.functional.pad(piece, (0, length - len(piece)))  # zeros past N
        phi_codes, phi_scales = quantize(piece)
        start = fragment * length
        known = max(0, min(length, half - start))
        seen_phi = phi.clone()
        seen_phi[start : start + known] = dequantize(phi_codes, phi_scales)[:known]
        codes, magnitudes, sent = [], [], torch.zeros_like(v)
        kept_mask = torch.zeros(len(v), dtype=torch.bool, device=v.device)
        offset = 0
        for n in numels[len(numels) // 2 :]:
            part, out, mask = v[offset : offset + n], sent[offset : offset + n], kept_mask[offset : offset + n]
            full = n // CHUNK
            for start, rows, size in ((0, full, CHUNK), (full * CHUNK, 1 if n % CHUNK else 0, n % CHUNK)):
                if rows == 0:
                    continue
                block = part[start : start + rows * size].view(rows, size)
                k = min(TOP_K, size)
                idx, code, lower, upper = _select(block, k)
                out[start : start + rows * size].view(rows, size).scatter_(1, idx, _values(code, lower, upper))
                mask[start : start + rows * size].view(rows, size).scatter_(1, idx, True)
                codes.append(code.reshape(-1))
                magnitudes.append(torch.stack([lower, upper], dim=1).reshape(-1))
            offset += n
        state["residual"] = v - sent
        # Selected on the payload's device; on a GPU the bits are packed there too (only the
        # packed bytes cross the bus: 1/32 of the bitmap's bools, 1/16 of the codes' int64,
        # where the host's NumPy packing took seconds a round for gpt-125m on an H200 beside
        # three other workers); the bytes are put together on the CPU.
        if self.pack_on_host(v):
            kept_bytes = torch.from_numpy(np.packbits(kept_mask.cpu().numpy(), bitorder="little"))
            code_bytes = pack_bits(torch.cat(codes), 2)
        else:
            kept_bytes, code_bytes = _pack_lsb_first(kept_mask, 1), _pack_lsb_first(torch.cat(codes), 2)
        wire = torch.cat(
            [
                torch.tensor([fragment], dtype=torch.int32).view(torch.uint8),
                phi_codes.cpu().view(torch.uint8),
                phi_scales.cpu().view(torch.uint8),
                kept_bytes,
                code_bytes,
                torch.cat(magnitudes).to(torch.float32).cpu().view(torch.uint8),
            ]
        )
        return wire, torch.cat([seen_phi, sent])

    @staticmethod
    def pack_on_host(t: torch.Tensor) -> bool:
        """Bits packed and parsed with NumPy on the host (a CPU's tensors), or with torch
        where ``t`` is (tests set ``torch_codec`` to run that path on a CPU too)."""
        return t.device.type == "cpu" and not SparseLoCo.torch_codec

    torch_codec = False
    """Tests only: the torch path (a GPU's) on CPU tensors, to compare its bytes with NumPy's."""

    def decode(self, wire: torch.Tensor, numels: list[int], *, fill: torch.Tensor | None = None) -> torch.Tensor:
        length, phi_nbytes, chunks, _ = _layout(numels)
        if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() != self.nbytes(numels):
            raise ValueError(f"a sparseloco payload of these pieces is {self.nbytes(numels)} bytes")
        if fill is None or fill.numel() != sum(numels):
            raise ValueError("a sparseloco payload needs our own payload as sent to fill in what it leaves out")
        if not self.pack_on_host(fill):
            return self._decode_on(wire.to(fill.device), numels, fill)
        wire = wire.cpu()  # parsed on the CPU; the result lands on ``fill``'s device
        data = wire.numpy()
        cursor = 0

        def take(nbytes: int) -> np.ndarray:
            nonlocal cursor
            part = data[cursor : cursor + nbytes].copy()  # a copy: aligned for the views
            cursor += nbytes
            return part

        fragment = int(take(4).view("<i4")[0])
        if not 0 <= fragment < FRAGMENTS:
            raise ValueError(f"fragment {fragment} is not one of 0..{FRAGMENTS - 1}")
        phi_codes = torch.from_numpy(take(length).view(np.int8))
        phi_scales = torch.from_numpy(take(phi_nbytes - length).view("<f4"))
        # The Δ sections, as training/encodings/topk.py lays them out (and checks them).
        found, sent, _ = topk.decode(take(topk.nbytes(chunks)), chunks)
        phi = dequantize(phi_codes, phi_scales)
        return _assemble(numels, fill, fragment, phi, torch.from_numpy(found), torch.from_numpy(sent))

    def _decode_on(self, wire: torch.Tensor, numels: list[int], fill: torch.Tensor) -> torch.Tensor:
        """``decode`` where ``fill`` is (a GPU: the payload parsed in its memory), the same
        numbers and refusals as the host's NumPy path (tests/test_sparseloco.py)."""
        length, phi_nbytes, chunks, _ = _layout(numels)
        fragment = int(wire[:4].clone().view(torch.int32).item())
        if not 0 <= fragment < FRAGMENTS:
            raise ValueError(f"fragment {fragment} is not one of 0..{FRAGMENTS - 1}")
        phi_codes = wire[4 : 4 + length].view(torch.int8)
        phi_scales = wire[4 + length : 4 + phi_nbytes].clone().view(torch.float32)  # a copy: aligned for the view
        positions, values = _decode_delta_on(wire[4 + phi_nbytes :], chunks)
        return _assemble(numels, fill, fragment, dequantize(phi_codes, phi_scales), positions, values)


def _assemble(
    numels: list[int],
    fill: torch.Tensor,
    fragment: int,
    phi: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """The decoded payload on ``fill``'s device: our own φ as sent, the partner's on its
    fragment (``phi``, dequantized: zeros past N), its Δ's sent ``values`` at ``positions``
    and zeros elsewhere (both decoders: NumPy's and torch's)."""
    length = _fragment_len(numels)
    half = sum(numels[: len(numels) // 2])
    out = torch.empty(sum(numels), dtype=torch.float32, device=fill.device)
    out[:half] = fill[:half]
    start = fragment * length
    known = max(0, min(length, half - start))
    out[start : start + known] = phi[:known].to(out.device)
    delta = out[half:]
    delta.zero_()
    delta[positions.to(out.device)] = values.to(out.device)
    return out


ENCODING = SparseLoCo()
