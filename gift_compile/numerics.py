"""FP8 codec, an emulated FP4 codec, fidelity metrics and FP8 boundary hits.

Everything here is a pure tensor function: no ``.item()``, no Python branch on a value,
so Inductor can trace and fuse it, and the eager and compiled results agree bit for bit.

The codec scales blocks of a tensor by ``amax / fp8_max`` and casts. Three properties the
rest of the project relies on:

* **Zero blocks are safe.** ``amax`` is clamped to a tiny positive number before it
  becomes a scale, so an all-zero block encodes as zeros instead of ``0/0``.
* **Non-finite values are never hidden.** A NaN makes ``amax`` NaN; an Inf makes the scale
  Inf, and ``Inf/Inf`` and ``0 * Inf`` are NaN. Either way the whole block decodes as NaN,
  so a trainer's non-finite check still fires after the reduction. (e4m3 would otherwise
  saturate Inf to 448 and silently hide it.)
* **Bits travel as uint8.** Gloo has no FP8 dtype, and an FP8 sum would lose precision; the
  payload is viewed as ``uint8`` (bit-exact both ways) and summed in fp32 after decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# Smallest amax turned into a scale. Far below any real gradient magnitude but large enough
# that amax / fp8_max stays a normal fp32 number, so x / scale never overflows for x <= amax.
_AMAX_FLOOR = 1e-30


def fp8_dtype(fmt: str) -> torch.dtype:
    try:
        return FP8_DTYPES[fmt]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}; allowed values: {list(FP8_DTYPES)}") from None


def fp8_max(fmt: str) -> float:
    return torch.finfo(fp8_dtype(fmt)).max


# Decoding is torch's own cast. Inductor's CPU code vectorizes float8 conversions (float8 is
# among its vector dtypes, int16 is not), so a kernel the codec fuses into stays a vector loop
# only if every op in it has a vector form: an earlier decode through fp16's bits with int16
# shifts made every such kernel scalar, 2-3x slower (benchmarks/results/codec_traffic.md).
def fp8_values(payload: torch.Tensor, fmt: str, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """fp32 ``payload.view(fp8).float() * scale`` for FP8 bits in a ``uint8`` tensor."""
    return payload.view(fp8_dtype(fmt)).float() * scale


def block_amax(x: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """Per-block ``max |x|`` in fp32 over ``x`` split evenly into ``blocks`` chunks."""
    return x.float().reshape(blocks, -1).abs().amax(dim=1)


def quantize(
    x: torch.Tensor, fmt: str, blocks: int = 1, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` as FP8 bits in a ``uint8`` tensor of ``x``'s shape, plus fp32 scales.

    ``x`` is split evenly into ``blocks`` chunks (in memory order), each with its own scale
    ``amax / fp8_max``. Pass ``amax`` to impose a scale (e.g. one max-synchronized across
    ranks). Returns ``(payload, scales)`` with ``scales.shape == (blocks,)``.
    """
    if x.numel() % blocks != 0:
        raise ValueError(f"cannot split a tensor of {x.numel()} elements into {blocks} equal scale blocks")
    fmax = fp8_max(fmt)
    if amax is None:
        amax = block_amax(x, blocks)
    scales = amax.clamp_min(_AMAX_FLOOR) / fmax
    scaled = x.float().reshape(blocks, -1) / scales[:, None]
    # The clamp matters for e5m2, whose cast overflows to Inf instead of saturating.
    # NaN passes through clamp, so non-finite inputs stay visible.
    encoded = scaled.clamp_min(-fmax).clamp_max(fmax).to(fp8_dtype(fmt))
    return encoded.view(torch.uint8).reshape(x.shape), scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """Decode ``quantize``'s output back to fp32 (same shape as ``payload``)."""
    blocks = scales.numel()
    decoded = fp8_values(payload.reshape(blocks, -1), fmt, scales.reshape(blocks, 1))
    return decoded.reshape(payload.shape)


def row_blocks(x: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, int]:
    """Pad ``x``'s dim 0 with zero rows to a multiple of ``block_rows``; return it and the block count."""
    pad = -x.shape[0] % block_rows
    x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
    return x, x.shape[0] // block_rows


def fp8_round_trip(x: torch.Tensor, fmt: str, scaling: str = "tensor", block_rows: int = 128) -> torch.Tensor:
    """``dequantize(quantize(x))`` with tensor or row-block scaling: the one-step FP8 error."""
    if scaling == "tensor":
        return dequantize(*quantize(x, fmt), fmt).to(x.dtype)
    if scaling == "row_block":
        padded, blocks = row_blocks(x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(-1, 1), block_rows)
        decoded = dequantize(*quantize(padded, fmt, blocks), fmt)
        return decoded[: x.shape[0]].reshape(x.shape).to(x.dtype)
    raise ValueError(f"unknown scaling {scaling!r}; allowed values: ['tensor', 'row_block']")


# FP4 E2M1 (OCP MX): sign, 2 exponent bits, 1 mantissa bit; magnitudes 0..6.
_FP4_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_e2m1_round_trip(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """Emulated FP4 E2M1 round trip with one fp32 scale per ``block_size`` elements.

    Rounds to the nearest grid value (ties to the larger magnitude). Emulation only:
    no hardware FP4 is involved; it answers how whitening interacts with a 3-bit format.
    """
    flat = x.float().reshape(-1)
    pad = -flat.numel() % block_size
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, block_size)
    grid = torch.tensor(_FP4_E2M1_GRID, dtype=torch.float32, device=x.device)
    scales = blocks.abs().amax(dim=1, keepdim=True).clamp_min(_AMAX_FLOOR) / grid[-1]
    magnitude = (blocks / scales).abs()
    midpoints = (grid[1:] + grid[:-1]) / 2
    rounded = grid[torch.bucketize(magnitude, midpoints, right=True)]
    decoded = torch.sign(blocks) * rounded * scales
    return decoded.reshape(-1)[: flat.numel()].reshape(x.shape)


class Fidelity(NamedTuple):
    """The paper's Eq. 15 metrics of an approximation ``approx`` of ``exact`` (0-d fp32 tensors)."""

    rel_l2: torch.Tensor
    cosine: torch.Tensor
    max_err: torch.Tensor
    mse: torch.Tensor
    sqnr_db: torch.Tensor


def fidelity(approx: torch.Tensor, exact: torch.Tensor) -> Fidelity:
    a, e = approx.double().reshape(-1), exact.double().reshape(-1)
    err = a - e
    err_sq, exact_sq = err.square().sum(), e.square().sum()
    return Fidelity(
        rel_l2=(err_sq.sqrt() / exact_sq.sqrt()).float(),
        cosine=torch.nn.functional.cosine_similarity(a, e, dim=0, eps=1e-300).float(),
        max_err=err.abs().max().float(),
        mse=(err_sq / e.numel()).float(),
        sqnr_db=(10 * torch.log10(exact_sq / err_sq)).float(),
    )


class BoundaryHits(NamedTuple):
    """FP8 boundary hits of one encoding (0-d int64 tensors)."""

    saturated: torch.Tensor
    """Elements encoded at +-fp8_max: clipped, or pinned exactly at the format's edge."""
    flushed: torch.Tensor
    """Non-zero elements that encode as zero (underflow below the smallest subnormal)."""


def boundary_hits(x: torch.Tensor, payload: torch.Tensor, fmt: str) -> BoundaryHits:
    decoded_unscaled = fp8_values(payload, fmt)
    return BoundaryHits(
        saturated=(decoded_unscaled.abs() >= fp8_max(fmt)).sum(),
        flushed=((decoded_unscaled == 0) & (x != 0)).sum(),
    )
