"""FP8 codec bounds.

Round-to-nearest into a format with m mantissa bits has relative error <= 2^-(m+1) for
values in the normal range; below it the absolute error is <= half the smallest subnormal
(2^-10 for e4m3, 2^-17 for e5m2) times the block scale. Scales are amax / fp8_max, so no
value saturates.
"""

import math

import pytest
import torch

from gift_compile.numerics import (
    boundary_hits,
    dequantize,
    fidelity,
    fp4_e2m1_round_trip,
    FP8_DTYPES,
    fp8_max,
    fp8_round_trip,
    quantize,
)

MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
HALF_MIN_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("blocks", [1, 4])
def test_round_trip_error_bound(fmt, blocks):
    torch.manual_seed(0)
    x = torch.randn(64, 48) * torch.logspace(-3, 2, 48)  # columns spanning 5 decades
    payload, scales = quantize(x, fmt, blocks)
    assert payload.dtype == torch.uint8 and payload.shape == x.shape and scales.shape == (blocks,)
    back = dequantize(payload, scales, fmt)
    scale_per_element = scales.repeat_interleave(x.numel() // blocks).reshape(x.shape)
    bound = torch.maximum(x.abs() * 2.0 ** -(MANTISSA_BITS[fmt] + 1), HALF_MIN_SUBNORMAL[fmt] * scale_per_element)
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())
    assert fidelity(back, x).rel_l2 <= 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def hard_fp8_inputs(fmt: str) -> torch.Tensor:
    """Every finite FP8 value, every midpoint between neighbours (round-half-to-even ties) and
    the fp32 numbers either side of each midpoint, signed zeros, NaN and a random bulk; an odd
    length, so a vector loop's tail is covered too."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[fmt]).float()
    values = values[values.isfinite()].unique()
    midpoints = ((values[1:].double() + values[:-1].double()) / 2).float()  # exact in fp32
    inf = torch.tensor(float("inf"))
    bulk = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * fp8_max(fmt) / 4
    x = torch.cat([values, midpoints, midpoints.nextafter(inf), midpoints.nextafter(-inf), bulk,
                   torch.tensor([0.0, -0.0, float("nan")])])
    return torch.cat([x, -x])


# Each format's bits as (exponent bits, mantissa bits, exponent bias), from the OCP FP8 definition.
FP8_LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}


def fp8_definition(code: int, fmt: str) -> float:
    """The value of an FP8 code written out from the format's definition (no torch cast):
    e4m3fn has no infinities and one NaN per sign (all ones); e5m2 is IEEE-like."""
    e_bits, m_bits, bias = FP8_LAYOUT[fmt]
    sign = -1.0 if code >> 7 else 1.0
    exponent, mantissa = (code >> m_bits) & ((1 << e_bits) - 1), code & ((1 << m_bits) - 1)
    top = (1 << e_bits) - 1
    if fmt == "e4m3" and exponent == top and mantissa == (1 << m_bits) - 1:
        return math.nan
    if fmt == "e5m2" and exponent == top:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:  # subnormal
        return sign * mantissa / (1 << m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_code_decodes_to_its_definition(fmt, compiled):
    # The decoder against an independent derivation: each of the 256 codes' value from its sign,
    # exponent and mantissa bits (every FP8 value is exact in fp32, signed zeros included).
    codes = torch.arange(256, dtype=torch.uint8)[None]
    decode = torch.compile(dequantize, fullgraph=True) if compiled else dequantize
    got = decode(codes, torch.tensor([1.0]), fmt)[0]
    want = torch.tensor([fp8_definition(c, fmt) for c in range(256)], dtype=torch.float32)
    assert torch.equal(got.isnan(), want.isnan())
    number = ~want.isnan()
    assert torch.equal(got[number].view(torch.int32), want[number].view(torch.int32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_compiled_fp8_codec_is_eagers_bit_for_bit(fmt):
    # Inductor compiles the cast to and from float8 into vector code; eager runs ATen's
    # conversion. The codec's compiled-vs-eager bit-exactness rests on the two agreeing on every
    # code and every rounding tie. Scale 1 (amax = fp8_max) puts the ties exactly where they are.
    x = hard_fp8_inputs(fmt)
    amax = torch.tensor([fp8_max(fmt)])
    eager_payload, _ = quantize(x, fmt, amax=amax)
    compiled_payload, _ = torch.compile(quantize, fullgraph=True)(x, fmt, amax=amax)
    number = ~x.isnan()  # a NaN's sign bit may differ (vector code keeps -NaN's); both are NaN codes
    assert torch.equal(compiled_payload[number], eager_payload[number])
    nan_code = {"e4m3": 0x7F, "e5m2": 0x7C}[fmt]  # an all-ones exponent (and e4m3's mantissa)
    assert bool(((compiled_payload[~number] & nan_code) == nan_code).all())
    # Decoding every code times scales that are powers of two, not, tiny (products fall to fp32
    # subnormals) and huge (the largest an amax can give): the same fp32 bits, signed zeros too.
    codes = torch.arange(256, dtype=torch.uint8)[None]
    decode = torch.compile(dequantize, fullgraph=True)
    for scale in (1.0, 0.75, 3.1e-3, 1e-41 / fp8_max(fmt), torch.finfo(torch.float32).max / fp8_max(fmt)):
        scales = torch.tensor([scale])
        got, expected = decode(codes, scales, fmt), dequantize(codes, scales, fmt)
        assert torch.equal(got.isnan(), expected.isnan()), scale
        finite = ~expected.isnan()
        assert torch.equal(got[finite].view(torch.int32), expected[finite].view(torch.int32)), scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_zero_tensor_round_trips_to_zero(fmt):
    payload, scales = quantize(torch.zeros(5, 7), fmt)
    assert bool(torch.isfinite(scales).all())
    assert torch.equal(dequantize(payload, scales, fmt), torch.zeros(5, 7))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_stay_visible(fmt, bad):
    # e4m3 alone would saturate inf to 448 and hide it; the codec must not.
    x = torch.randn(4, 4)
    x[1, 2] = bad
    back = fp8_round_trip(x, fmt)
    assert not bool(torch.isfinite(back).all())
    assert bool(torch.isnan(back[1, 2]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_amax_maps_to_format_max_without_overflow(fmt):
    x = torch.tensor([1.0, -3.0, 0.25, 3.0])
    payload, scales = quantize(x, fmt)
    encoded = payload.view(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2).float()
    assert encoded.abs().max() == fp8_max(fmt)
    assert torch.equal(dequantize(payload, scales, fmt)[[1, 3]], torch.tensor([-3.0, 3.0]))


def test_boundary_hits_count_saturation_and_flush():
    # amax 1.0 -> scale 1/448; 1e-6 * 448 = 4.5e-4 < 2^-10 (half of e4m3's smallest subnormal) flushes.
    x = torch.tensor([1.0, -1.0, 0.5, 1e-6, -1e-6, 0.0, 0.01])
    payload, _ = quantize(x, "e4m3")
    hits = boundary_hits(x, payload, "e4m3")
    assert int(hits.saturated) == 2 and int(hits.flushed) == 2


def test_row_block_scaling_tracks_rows_of_different_magnitude():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:128] *= 1e-4  # tiny rows lose everything to the subnormal floor under one tensor scale
    alone = fidelity(fp8_round_trip(x[:128], "e4m3"), x[:128]).rel_l2
    whole_tensor = fidelity(fp8_round_trip(x, "e4m3")[:128], x[:128]).rel_l2
    row_block = fidelity(fp8_round_trip(x, "e4m3", "row_block", 128)[:128], x[:128]).rel_l2
    # Each 128-row block gets its own scale: the small rows do as well as if sent alone.
    assert torch.equal(row_block, alone) and row_block < whole_tensor / 2


def test_fidelity_metrics_match_direct_formulas():
    exact = torch.tensor([3.0, 4.0])
    approx = torch.tensor([3.0, 5.0])
    f = fidelity(approx, exact)
    assert math.isclose(f.rel_l2.item(), 1 / 5, rel_tol=1e-6)
    assert math.isclose(f.max_err.item(), 1.0) and math.isclose(f.mse.item(), 0.5)
    assert math.isclose(f.cosine.item(), 29 / (5 * math.sqrt(34)), rel_tol=1e-6)
    assert math.isclose(f.sqnr_db.item(), 10 * math.log10(25), rel_tol=1e-6)


def test_fp4_round_trip_hits_the_e2m1_grid():
    x = torch.tensor([6.0, 2.9, -1.2, 0.2, 0.3, 5.1, 0.0, -6.0])
    back = fp4_e2m1_round_trip(x, block_size=8)  # amax 6 -> scale 1
    assert torch.equal(back, torch.tensor([6.0, 3.0, -1.0, 0.0, 0.5, 6.0, 0.0, -6.0]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_compiled_quantize_is_bit_identical_to_eager(fmt):
    torch.manual_seed(0)
    x = torch.randn(384, 96) * 3
    x[0, 0] = 0.0
    compiled = torch.compile(quantize, backend="inductor", fullgraph=True)
    eager_payload, eager_scales = quantize(x, fmt, 4)
    payload, scales = compiled(x, fmt, 4)
    assert torch.equal(payload, eager_payload) and torch.equal(scales, eager_scales)
