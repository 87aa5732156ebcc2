"""Top-k per chunk in 2-bit values, numpy only: the sparse section that SparseLoCo's Δ
(training/encodings/sparseloco.py, which selects with torch) and SPES's delta versions
(training/encodings/experts.py, which the daemon encodes: no torch there) share.

A vector of values cut into chunks (``chunk_sizes``) travels as three sections,
little-endian, where K = Σ min(TOP_K, c) over the chunks' sizes c:

    kept       ⌈Σc / 8⌉ bytes: a bitmap over the values, LSB first, 1 where a value is
               sent; a chunk of c values has exactly min(TOP_K, c) ones, the bits past
               Σc are zero
    codes      ⌈2·K / 8⌉ bytes: per sent value, in the bitmap's order, 2 bits LSB first:
               bit 0 its sign (1: negative), bit 1 upper half (1) or lower (0)
    magnitudes 2 float32 per chunk, chunks in order: the mean magnitude of the lower half
               of its sent values (the ⌊k/2⌋ smallest), then of the upper half

A value comes back as its half's mean with its sign: per chunk, an orthogonal projection
of the chunk onto what was sent, so ‖sent‖ ≤ ‖values‖ and ‖values − sent‖ ≤ ‖values‖
(training/encodings/experts.py relies on it).
"""

import numpy as np

CHUNK = 4096
TOP_K = 1024

CODES = np.array([[(byte >> (2 * i)) & 3 for i in range(4)] for byte in range(256)], dtype=np.uint8)
"""A byte of codes → its four 2-bit codes, LSB first."""


def chunk_sizes(numel: int) -> list[int]:
    """The chunks of a vector of ``numel`` values."""
    return [CHUNK] * (numel // CHUNK) + ([numel % CHUNK] if numel % CHUNK else [])


def num_kept(chunks: list[int]) -> int:
    return sum(min(TOP_K, c) for c in chunks)


def nbytes(chunks: list[int]) -> int:
    """The three sections' bytes for these chunks."""
    return -(-sum(chunks) // 8) + -(-2 * num_kept(chunks) // 8) + 8 * len(chunks)


def _select(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks (m, c) float32 → (kept mask (m, c), codes (m, k) in index order, magnitudes (m, 2))."""
    magnitudes = np.abs(rows)
    picked = np.sort(np.argpartition(-magnitudes, k - 1, axis=1)[:, :k], axis=1)  # in index order
    values = np.take_along_axis(rows, picked, axis=1)
    picked_magnitudes = np.abs(values)
    half = k // 2
    tops = np.argpartition(-picked_magnitudes, k - half - 1, axis=1)[:, : k - half]
    upper = np.zeros(picked.shape, dtype=bool)
    np.put_along_axis(upper, tops, True, axis=1)
    lower_mean = (picked_magnitudes * ~upper).sum(axis=1, dtype=np.float64) / max(half, 1)
    upper_mean = (picked_magnitudes * upper).sum(axis=1, dtype=np.float64) / (k - half)
    mask = np.zeros(rows.shape, dtype=bool)
    np.put_along_axis(mask, picked, True, axis=1)
    codes = (values < 0).astype(np.uint8) | (upper.astype(np.uint8) << 1)
    return mask, codes, np.stack([lower_mean, upper_mean], axis=1).astype("<f4")


def encode(values: np.ndarray) -> bytes:
    """Float32 values (finite) → the three sections over ``chunk_sizes(len(values))``."""
    numel = len(values)
    full = numel // CHUNK
    masks, codes, magnitudes = [], [], []
    for start, rows, size in ((0, full, CHUNK), (full * CHUNK, 1 if numel % CHUNK else 0, numel % CHUNK)):
        if rows == 0:
            continue
        mask, code, magnitude = _select(values[start : start + rows * size].reshape(rows, size), min(TOP_K, size))
        masks.append(mask.reshape(-1))
        codes.append(code.reshape(-1))
        magnitudes.append(magnitude.reshape(-1))
    if not masks:
        return b""
    stream = np.concatenate(codes).astype(np.uint8)
    stream = np.pad(stream, (0, (-len(stream)) % 4)).reshape(-1, 4)
    packed = stream[:, 0] | (stream[:, 1] << 2) | (stream[:, 2] << 4) | (stream[:, 3] << 6)
    return (
        np.packbits(np.concatenate(masks), bitorder="little").tobytes()
        + packed.astype(np.uint8).tobytes()
        + np.concatenate(magnitudes).astype("<f4").tobytes()
    )


def decode(data: np.ndarray, chunks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three sections (uint8, exactly ``nbytes(chunks)``) → (positions of the sent
    values, ascending; their float32 values; every chunk's two magnitudes). ``ValueError``
    for a chunk with another count of ones or a bit set past the last value; magnitudes
    come out as they are (the caller refuses what it must)."""
    if data.dtype != np.uint8 or len(data) != nbytes(chunks):
        raise ValueError(f"these chunks' sparse values are {nbytes(chunks)} bytes, got {len(data)}")
    total, kept = sum(chunks), num_kept(chunks)
    mask_end = -(-total // 8)
    codes_end = mask_end + -(-2 * kept // 8)
    mask = np.unpackbits(data[:mask_end], bitorder="little").view(np.bool_)  # a byte a value
    codes = CODES[data[mask_end:codes_end]].reshape(-1)[:kept]  # 4 codes a byte
    magnitudes = data[codes_end:].copy().view("<f4")  # a copy: aligned for the view
    if mask[total:].any():
        raise ValueError("bits set past the last value")
    sizes = np.array(chunks, dtype=np.int64)
    per_chunk = np.minimum(sizes, TOP_K)
    found = np.flatnonzero(mask)  # ascending: chunk by chunk
    if not np.array_equal(np.diff(np.searchsorted(found, np.cumsum(sizes)), prepend=0), per_chunk):
        raise ValueError("a chunk sends another number of values than its share")
    # Each value's magnitude: its chunk's lower (code bit 1 clear) or upper mean; its sign, bit 0.
    which = np.repeat(2 * np.arange(len(chunks)), per_chunk) + (codes >> 1)
    sign = 1.0 - 2.0 * (codes & 1).astype(np.float32)
    return found, (magnitudes[which] * sign).astype(np.float32), magnitudes
