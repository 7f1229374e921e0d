"""The bucketed weight transfer's wire format (issue 42): pieces, buckets, FP8 and delta encoding.

A version is cut into :class:`Piece` s: a region ``[offset, offset + size)`` (every dim) of one
state-dict tensor of global ``shape``, as one trainer rank owns it (the whole tensor when rank 0
gathered it; an FSDP2 / expert-parallel shard when every rank sends its own). Pieces larger than a
bucket are split along dim 0 (in whole 128-row FP8 blocks for a 2-D FP8 piece). :func:`plan_buckets`
packs them, in order, into buckets of at most ``bucket_bytes`` (a piece larger than that alone);
each entry records the piece's byte position in its bucket. On the wire a piece is either

- raw: the region in the receiving engine's ``dtype`` (``piece.dtype``), C-contiguous, or
- FP8 (``piece.fp8``): e4m3 bytes of the region, then its float32 block scales ``[(G,) ceil(N/128),
  ceil(K/128)]`` (DeepGEMM's 128x128 weight blocks, ``primerl.kernels.fp8.quant_per_block``).

A bucket travels whole (``kind`` :data:`FULL`) or as a delta (:data:`DELTA`): the xor of its raw
bytes with the same bucket of the previous version, zstd-compressed. Either way ``crc32`` of the
raw bytes goes with it, so the receiver detects a delta applied to the wrong base (or corrupted)
and never loads it (:class:`DeltaDecodeError`). Without deltas a bucket travels as its pieces
(:data:`PIECES`, :func:`piece_wire`): one message per piece (an FP8 piece: its e4m3 bytes, then its
scales), sent from the trainer's own tensors and received straight into the assembled tensors where
the region is contiguous there (:func:`contiguous_in_full`): no packing copy on either side.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

__all__ = ["DELTA", "FP8_BLOCK", "FULL", "PIECES", "DeltaDecodeError", "Piece", "decode_bucket", "decode_delta",
           "encode_bucket", "encode_delta", "fp8_transferable", "layout_from_json", "layout_to_json",
           "contiguous_in_full", "piece_wire", "plan_buckets", "split_pieces", "wire_bytes"]

FULL, DELTA, PIECES = 0, 1, 2
FP8_BLOCK = (128, 128)


class DeltaDecodeError(ValueError):
    """A bucket whose bytes do not match its checksum (a corrupted delta, or one on the wrong base)."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def fp8_transferable(name: str, dtype: torch.dtype, shape) -> bool:
    """Whether a weight travels as block-FP8 with ``dtype = "fp8"``: every floating 2-D / 3-D weight
    (``[N, K]``, experts ``[G, N, K]``; the embedding and the output head too: in transit, what
    counts is the bytes, and the receiver dequantizes what it does not compute with in FP8)."""
    return dtype.is_floating_point and len(shape) in (2, 3)


@dataclass(frozen=True)
class Piece:
    """One region of a tensor on the wire. ``dtype``: the receiving engine's (name, e.g. "bfloat16");
    ``shape``: the global tensor's; ``offset`` / ``size``: the region (every dim); ``fp8``: block-FP8."""

    name: str
    dtype: str
    shape: tuple
    offset: tuple
    size: tuple
    fp8: bool = False

    @property
    def numel(self) -> int:
        return _numel(self.size)

    @property
    def nbytes(self) -> int:
        if self.fp8:
            *g, n, k = self.size
            return self.numel + 4 * _numel(g) * -(-n // FP8_BLOCK[0]) * -(-k // FP8_BLOCK[1])
        return self.numel * torch.empty((), dtype=_dtype(self.dtype)).element_size()

    @property
    def index(self) -> tuple:
        """The region as a tuple of slices of the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.size))

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), list(self.offset), list(self.size), self.fp8]

    @classmethod
    def from_json(cls, j) -> "Piece":
        return cls(j[0], j[1], tuple(j[2]), tuple(j[3]), tuple(j[4]), bool(j[5]))


def split_pieces(piece: Piece, bucket_bytes: int) -> list[Piece]:
    """``piece`` cut along dim 0 into pieces of at most ``bucket_bytes`` (a 2-D FP8 piece in whole
    128-row blocks, so its blocks stay those of the unsplit region; at least one row / block each)."""
    if piece.nbytes <= bucket_bytes or not piece.size or piece.size[0] <= 1:
        return [piece]
    rows = piece.size[0]
    step = 128 if piece.fp8 and len(piece.size) == 2 else 1
    row_bytes = piece.nbytes / rows
    per = max(step, int(bucket_bytes // row_bytes) // step * step)
    if per >= rows:
        return [piece]
    out = []
    for start in range(0, rows, per):
        n = min(per, rows - start)
        out.append(Piece(piece.name, piece.dtype, piece.shape, (piece.offset[0] + start, *piece.offset[1:]),
                         (n, *piece.size[1:]), piece.fp8))
    return out


def plan_buckets(pieces: Iterable[Piece], bucket_bytes: int) -> list[list[tuple[Piece, int]]]:
    """Pieces in order, packed greedily: ``[[(piece, byte position in the bucket), ...], ...]``.
    A bucket holds at most ``bucket_bytes`` unless one piece alone is larger."""
    buckets: list[list[tuple[Piece, int]]] = []
    cur: list[tuple[Piece, int]] = []
    used = 0
    for p in pieces:
        if cur and used + p.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append((p, used))
        used += p.nbytes
    if cur:
        buckets.append(cur)
    return buckets


def wire_bytes(bucket: list[tuple[Piece, int]]) -> int:
    """The raw size of one bucket."""
    p, pos = bucket[-1]
    return pos + p.nbytes


def layout_to_json(buckets: list[list[tuple[Piece, int]]]) -> list:
    return [[[*p.to_json(), pos] for p, pos in b] for b in buckets]


def layout_from_json(j: list) -> list[list[tuple[Piece, int]]]:
    return [[(Piece.from_json(e[:6]), int(e[6])) for e in b] for b in j]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def encode_piece(piece: Piece, t: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``t`` (the region, any floating dtype) into ``out`` (uint8, ``piece.nbytes``)."""
    if tuple(t.shape) != tuple(piece.size):
        raise ValueError(f"weight transfer: {piece.name} region {list(t.shape)}, the layout says {list(piece.size)}")
    if piece.fp8:
        from primerl.kernels.fp8 import quant_per_block

        q, sf = quant_per_block(t.float(), FP8_BLOCK)
        out[:piece.numel].copy_(_as_bytes(q).cpu() if out.device != q.device else _as_bytes(q))
        out[piece.numel:].copy_(_as_bytes(sf).to(out.device))
        return
    want = _dtype(piece.dtype)
    out.copy_(_as_bytes(t.detach().to(device=out.device, dtype=want)))


def piece_wire(piece: Piece, t: torch.Tensor, device) -> list[torch.Tensor]:
    """The messages of one piece sent as itself (:data:`PIECES`): flat uint8 views of ``t`` in the
    piece's dtype on ``device`` (no copy when it already is that), or, FP8, the e4m3 bytes and then
    the float32 block scales; ``piece.nbytes`` in all."""
    if tuple(t.shape) != tuple(piece.size):
        raise ValueError(f"weight transfer: {piece.name} region {list(t.shape)}, the layout says {list(piece.size)}")
    if piece.fp8:
        from primerl.kernels.fp8 import quant_per_block

        q, sf = quant_per_block(t.detach().to(device).float(), FP8_BLOCK)
        return [_as_bytes(q), _as_bytes(sf)]
    return [_as_bytes(t.detach().to(device=device, dtype=_dtype(piece.dtype)))]


def contiguous_in_full(piece: Piece) -> bool:
    """Whether the region is one contiguous run of its full tensor: a range of dim 0 (every other dim
    whole), as FSDP2 / expert-parallel shards and split pieces are."""
    return all(o == 0 and s == n for o, s, n in zip(piece.offset[1:], piece.size[1:], piece.shape[1:]))


def decode_piece(piece: Piece, raw: torch.Tensor) -> torch.Tensor:
    """The region from its wire bytes ``raw`` (uint8, ``piece.nbytes``), in ``piece.dtype``."""
    if piece.fp8:
        from primerl.kernels.fp8 import dequant

        *g, n, k = piece.size
        q = raw[:piece.numel].view(torch.float8_e4m3fn).reshape(piece.size)
        sf = raw[piece.numel:].view(torch.float32).reshape(*g, -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
        return dequant(q, sf, group_shape=FP8_BLOCK, out_dtype=_dtype(piece.dtype))
    return raw.view(_dtype(piece.dtype)).reshape(piece.size)


def encode_bucket(bucket: list[tuple[Piece, int]], tensors: Iterable[torch.Tensor], *,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """One flat uint8 bucket from its pieces' regions (in the bucket's order)."""
    buf = torch.empty(wire_bytes(bucket), dtype=torch.uint8, device=device)
    for (p, pos), t in zip(bucket, tensors, strict=True):
        encode_piece(p, t, buf[pos:pos + p.nbytes])
    return buf


def decode_bucket(bucket: list[tuple[Piece, int]], buf: torch.Tensor) -> Iterator[tuple[Piece, torch.Tensor]]:
    """``(piece, region tensor)`` for every piece of a received bucket (views of ``buf`` when raw)."""
    for p, pos in bucket:
        yield p, decode_piece(p, buf[pos:pos + p.nbytes])


# ------------------------------------------------------------------------------------------ delta
def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bytewise xor of two equal-length uint8 arrays (8 bytes at a time where the length allows)."""
    if a.nbytes != b.nbytes:
        raise ValueError(f"delta: the bucket has {a.nbytes} bytes, its base {b.nbytes}")
    if a.nbytes % 8 == 0:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(a, b)


def checksum(raw: np.ndarray) -> int:
    return zlib.crc32(memoryview(raw)) & 0xFFFFFFFF


def encode_delta(raw: np.ndarray, base: np.ndarray, *, level: int = 1) -> bytes:
    """zstd(raw xor base): what a delta bucket carries."""
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(memoryview(_xor(raw, base)))


def decode_delta(payload, base: np.ndarray, crc: int) -> np.ndarray:
    """The raw bucket from a delta on ``base``; raises :class:`DeltaDecodeError` when the result's
    checksum is not ``crc`` (or the payload is not a zstd frame of the bucket's size)."""
    import zstandard

    try:
        x = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=base.nbytes)
    except zstandard.ZstdError as e:
        raise DeltaDecodeError(f"delta: the payload does not decompress ({e})") from e
    if len(x) != base.nbytes:
        raise DeltaDecodeError(f"delta: {len(x)} bytes after decompression, the bucket has {base.nbytes}")
    raw = _xor(np.frombuffer(x, dtype=np.uint8), base)
    got = checksum(raw)
    if got != crc:
        raise DeltaDecodeError(f"delta: checksum {got:#010x} of the result, the sender's is {crc:#010x}")
    return raw


def header_bytes(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
