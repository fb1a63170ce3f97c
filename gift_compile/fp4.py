"""FP4 on the wire: E2M1 values with block scales, two values per byte (NVFP4- and MXFP4-style).

E2M1 (OCP MX): a sign, 2 exponent bits and 1 mantissa bit; the magnitudes are
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and a value's 3-bit code is its index in that list
(``exponent * 2 + mantissa``). Blocks are consecutive elements of a chunk in row-major order,
so for a weight gradient whose ``d_in`` is a multiple of the block (every Llama layer) each
block lies in one row, along ``d_in``, the axis input-side whitening mixes; each block has its
own scale:

* ``nvfp4``: 16 elements per block, an E4M3 block scale (1 byte) times one fp32 tensor scale
  per sender: 4.5 bits per element. The tensor scale maps the sender's largest magnitude to
  ``6 * 448``, so every block scale ``block_amax * 448 / amax`` fits E4M3.
* ``mxfp4``: 32 elements per block, a power-of-two E8M0 block scale (1 byte,
  ``2^(floor(log2 block_amax) - 2)``: the largest magnitude lands in [4, 8) and saturates at
  6): 4.25 bits per element.

Values round to the nearest E2M1 number, ties to the even code (a value's index counts the
midpoints between grid neighbours that it lies above, a tie counting where the upper code is
even), and saturate at 6. Like the FP8 codec, nothing here branches on a value (Inductor
traces and fuses it; eager and compiled agree bit for bit), zero blocks are safe, and a
sender with a NaN or Inf anywhere sends every block's scale as NaN (E2M1 has no NaN: the
scales carry it), so a non-finite gradient reaches every rank's shard, as with FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-30  # as numerics._AMAX_FLOOR: an all-zero tensor encodes as zeros, not 0/0


@dataclass(frozen=True)
class Fp4Format:
    name: str
    block: int
    """Elements per block scale, along the last dimension."""
    tensor_scale: bool
    """A fp32 tensor scale per sender too (NVFP4)."""


FP4_FORMATS = {"nvfp4": Fp4Format("nvfp4", 16, True), "mxfp4": Fp4Format("mxfp4", 32, False)}


def fp4_format(name: str) -> Fp4Format:
    try:
        return FP4_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP4 format {name!r}; allowed values: {list(FP4_FORMATS)}") from None


# The midpoints between neighbouring E2M1 magnitudes, each with whether a value exactly on it
# rounds up: a tie goes to the even code (the upper neighbour's code is even where True).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Codes (0..15 as fp32: sign * 8 + index) of fp32 values already divided by their scale.

    The index counts the midpoints a magnitude lies above (so it saturates at 6, and a NaN,
    above none, gets code 0: its block's scale is NaN, see encode). Codes stay fp32 until they
    are packed: compares and adds in fp32 vectorize on every backend, uint8 bit arithmetic
    did not (6x slower on CPU Inductor)."""
    magnitude = v.abs()
    index = sum(((magnitude >= m) if up else (magnitude > m)).float() for m, up in _MIDPOINTS)
    return index + (1 - torch.copysign(torch.ones_like(v), v)) * 4  # + 8 where the sign bit is set, as signbit


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``e2m1_codes``."""
    negative = codes >= 8
    index = codes - negative.float() * 8
    magnitude = torch.where(index < 4, index * 0.5, torch.where(index < 6, index - 2, index * 2 - 8))
    return torch.where(negative, -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte (``uint8``) along the last dimension (even element in the low nibble)."""
    return (codes[..., 0::2] + codes[..., 1::2] * 16).to(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 codes of :func:`pack`'s bytes."""
    packed = packed.float()
    high = torch.floor(packed * (1 / 16))
    return torch.stack([packed - high * 16, high], dim=-1).reshape(*packed.shape[:-1], -1)


def padded_numel(numel: int, fmt: Fp4Format) -> int:
    return -(-numel // fmt.block) * fmt.block


def message_bytes(rows: int, cols: int, fmt: Fp4Format) -> int:
    """Bytes of one encoded ``rows x cols`` chunk: payload, block scales and the tensor scale."""
    numel = padded_numel(rows * cols, fmt)
    return numel // 2 + numel // fmt.block + (4 if fmt.tensor_scale else 0)


def _blocks(chunks: torch.Tensor, fmt: Fp4Format) -> torch.Tensor:
    """``(n, rows, cols)`` as ``(n, blocks, block)`` fp32, zero-padded at the end of each chunk."""
    n = chunks.shape[0]
    flat = chunks.reshape(n, -1).float()
    return F.pad(flat, (0, padded_numel(flat.shape[1], fmt) - flat.shape[1])).reshape(n, -1, fmt.block)


def _mx_scale_bytes(block_amax: torch.Tensor) -> torch.Tensor:
    # floor(log2 amax) is the biased fp32 exponent minus 127 (exact, no log); E8M0 stores
    # exponent + 127, so the byte is the fp32 exponent minus 2 (emax of E2M1). 255 is NaN.
    biased = (block_amax.view(torch.int32) >> 23) & 255
    return torch.where(torch.isfinite(block_amax), (biased - 2).clamp(1, 254), 255).to(torch.uint8)


def _mx_scales(scale_bytes: torch.Tensor) -> torch.Tensor:
    powers = (scale_bytes.to(torch.int32) << 23).view(torch.float32)  # 2^(byte - 127), byte in [1, 254]
    return torch.where(scale_bytes == 255, torch.full_like(powers, float("nan")), powers)


def encode(chunks: torch.Tensor, fmt: Fp4Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode ``(n, rows, cols)`` as one uint8 message per chunk ``[payload | block scales |
    tensor scale]`` (all chunks are one sender's: one tensor scale). Returns the messages, what
    they decode to, and the boundary hits ``[saturated, flushed]`` (fp32): elements sent at the
    format's largest magnitude, and nonzero elements sent as zero."""
    n = chunks.shape[0]
    blocks = _blocks(chunks, fmt)
    block_amax = blocks.abs().amax(dim=-1)
    if fmt.tensor_scale:
        tensor_scale = blocks.abs().amax().clamp_min(_AMAX_FLOOR) / (E2M1_MAX * _E4M3_MAX)
        block_scales = (block_amax / (E2M1_MAX * tensor_scale)).clamp_max(_E4M3_MAX).to(torch.float8_e4m3fn)
        scale_bytes = block_scales.view(torch.uint8)
        tail = tensor_scale.reshape(1).expand(n).contiguous().view(torch.uint8).reshape(n, 4)
        scales = block_scales.float() * tensor_scale
    else:
        # A NaN/Inf anywhere poisons every block of the sender (NVFP4 does it by its tensor scale).
        scale_bytes = torch.where(torch.isfinite(block_amax).all(), _mx_scale_bytes(block_amax), 255)
        tail = None
        scales = _mx_scales(scale_bytes)
    # A block whose scale rounded to 0 (far below the tensor's largest block) sends zeros.
    codes = e2m1_codes(blocks / torch.where(scales > 0, scales, 1.0)[..., None])
    sent = e2m1_values(codes) * scales[..., None]
    hits = torch.stack([((codes == 7) | (codes == 15)).sum(), ((sent == 0) & (blocks != 0)).sum()]).float()
    parts = [pack(codes.reshape(n, -1)), scale_bytes.reshape(n, -1)] + ([tail] if tail is not None else [])
    sent = sent.reshape(n, -1)[:, : chunks[0].numel()].reshape(chunks.shape)
    return torch.cat(parts, dim=1), sent, hits


def decode(messages: torch.Tensor, rows: int, cols: int, fmt: Fp4Format) -> torch.Tensor:
    """Inverse of :func:`encode`: ``(n, message bytes)`` -> ``(n, rows, cols)`` fp32."""
    n = messages.shape[0]
    numel = padded_numel(rows * cols, fmt)
    codes = unpack(messages[:, : numel // 2])
    scale_bytes = messages[:, numel // 2 : numel // 2 + numel // fmt.block]
    if fmt.tensor_scale:
        # A copy, never a view: the tensor scale's offset need not be a multiple of 4.
        tensor_scale = messages[:, numel // 2 + numel // fmt.block :].clone(memory_format=torch.contiguous_format).view(torch.float32)
        scales = scale_bytes.view(torch.float8_e4m3fn).float() * tensor_scale
    else:
        scales = _mx_scales(scale_bytes)
    values = e2m1_values(codes).reshape(n, -1, fmt.block) * scales[..., None]
    return values.reshape(n, -1)[:, : rows * cols].reshape(n, rows, cols)


def fp4_round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``decode(encode(x))`` of a 2-D tensor as one sender's message: the one-step FP4 error."""
    f = fp4_format(fmt)
    rows, cols = x.reshape(x.shape[0], -1).shape
    _, sent, _ = encode(x.reshape(1, rows, cols), f)
    return sent.reshape(x.shape).to(x.dtype)


__all__ = ["E2M1_MAX", "FP4_FORMATS", "Fp4Format", "decode", "e2m1_codes", "e2m1_values", "encode", "fp4_format",
           "fp4_round_trip", "message_bytes", "pack", "padded_numel", "unpack"]
