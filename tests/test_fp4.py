"""The FP4 codec (``gift_compile/fp4.py``) against FP4 written out from its definition
(``tests/oracle.py``: the E2M1 grid from sign/exponent/mantissa, ties to the even mantissa,
E4M3 / power-of-two block scales computed as the formats define them).

Bit for bit: the library rounds fp32 values, the oracle float64 ones; they can differ only
where an fp32 rounding lands exactly on an E2M1 midpoint. Random data rarely does (measured: one
element in 600 random 64 x 256 tensors, whose ``x / scale`` is 2.5 in fp32, a tie the library
sends to the even code 2, and 2.5000001 in float64), so the tests' seeds are fixed: a seed drawn
from Python's ``hash`` of a string changed with every process and once hit such an element.
"""

import zlib

import pytest
import torch

import oracle
from gift_compile import fp4

FORMATS = ["nvfp4", "mxfp4"]


def test_e2m1_rounds_every_grid_point_and_midpoint_as_the_definition_says():
    values = torch.arange(-8 * 64, 8 * 64 + 1, dtype=torch.float64) / 64  # every multiple of 1/64 in [-8, 8]: all ties
    got = fp4.e2m1_values(fp4.e2m1_codes(values.float())).double()
    assert torch.equal(got, oracle.e2m1(values))
    assert oracle.E2M1_GRID == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_codes_pack_two_per_byte_and_back():
    codes = torch.randint(0, 16, (3, 40)).float()
    packed = fp4.pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 20) and torch.equal(fp4.unpack(packed), codes)
    assert packed[0, 0] == codes[0, 0] + 16 * codes[0, 1]  # the even element in the low nibble


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(64, 256), (37, 100), (5, 7), (300,)], ids=str)
def test_round_trip_equals_the_oracle(fmt, shape):
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt} {shape}".encode()))
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    got = fp4.fp4_round_trip(x.reshape(shape[0], -1), fmt).reshape(shape)
    assert torch.equal(got, oracle.fp4_round_trip(x, fmt).float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_messages_decode_to_what_the_sender_kept(fmt):
    f = fp4.fp4_format(fmt)
    chunks = torch.randn(3, 10, 48)
    messages, sent, hits = fp4.encode(chunks, f)
    assert messages.dtype == torch.uint8 and messages.shape == (3, fp4.message_bytes(10, 48, f))
    assert torch.equal(fp4.decode(messages, 10, 48, f), sent)
    assert hits[0] >= 3  # each sender's largest block element is sent at 6 x its scale (or saturates)
    assert fp4.message_bytes(16, 64, f) * 8 / (16 * 64) == {"nvfp4": 4.53125, "mxfp4": 4.25}[fmt]  # bits per value


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_are_exact_and_non_finite_values_poison_the_whole_message(fmt):
    assert torch.equal(fp4.fp4_round_trip(torch.zeros(4, 32), fmt), torch.zeros(4, 32))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(8, 64)
        x[6, 3] = bad
        assert bool(torch.isnan(fp4.fp4_round_trip(x, fmt)).all())  # E2M1 has no NaN: the scales carry it


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_encoding_is_bit_identical_to_eager(fmt):
    x = torch.randn(32, 96) * 3
    compiled = torch.compile(fp4.fp4_round_trip, fullgraph=True)
    assert torch.equal(compiled(x, fmt), fp4.fp4_round_trip(x, fmt))
