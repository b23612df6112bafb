"""ckptkit casts between floating dtypes and (de)quantizes float8 in numpy; each conversion must give the bits
torch's own casts give, on every float8 byte and on the values where rounding is decided (ties, subnormals, the
largest finite value, NaN, infinities)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptkit.io.floats import DECODES, ENCODES, convert, decode_table, encode, to_float32
from ckptkit.io.fp8 import dequantize, quantize, tile_scales


def _bits(t: torch.Tensor) -> np.ndarray:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width).numpy().copy()


def _edges() -> torch.Tensor:
    """float32 values on and around every rounding decision of e4m3fn and bfloat16, and the special values."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[~e4m3.isnan()]
    ups = torch.nextafter(e4m3, torch.full_like(e4m3, float("inf")))
    downs = torch.nextafter(e4m3, torch.full_like(e4m3, -float("inf")))
    mids = (e4m3[:-1] + e4m3[1:]) / 2 if len(e4m3) > 1 else e4m3
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 448.0, 463.99, 464.0, 464.01, 479.99, 480.0, 1e6, float("inf"), -float("inf"),
                            float("nan"), 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 1e-30, -1e-30])
    noise = torch.randn(4096, generator=gen) * torch.logspace(-12, 3, 4096)
    return torch.cat([e4m3, ups, downs, mids, -mids, special, noise])


@pytest.mark.parametrize("name", DECODES)
def test_decode_table_gives_torchs_float32_value_of_every_float8_byte(name):
    expected = torch.arange(256, dtype=torch.uint8).view(getattr(torch, name)).float()
    table = decode_table(name)
    assert np.array_equal(np.isnan(table), expected.isnan().numpy())
    keep = ~np.isnan(table)
    assert np.array_equal(table.view(np.uint32)[keep], _bits(expected)[keep].view(np.uint32))


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_encode_rounds_float32_as_torch_casts_it(name):
    values = torch.cat([_edges(), torch.randn(10000) * 1e4, torch.tensor([65504.0, 65520.0, 3.4e38])])
    values = torch.cat([values, (values.view(torch.int32) | 0x8000).view(torch.float32)])  # bf16 ties
    values = torch.cat([values, torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FA00000, 0x7F812345],
                                             dtype=torch.int64).to(torch.int32).view(torch.float32)])  # NaNs
    got = encode(values.numpy().copy(), name)
    assert np.array_equal(got.view(np.uint16), _bits(values.to(getattr(torch, name))).view(np.uint16))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64"])
def test_to_float32_reads_each_dtype_as_torch_widens_it(name):
    values = torch.randn(1000, dtype=torch.float64).to(getattr(torch, name))
    if name in ("bfloat16", "float16"):  # NaNs, signalling ones among them
        nans = torch.tensor([0x7C01, 0x7D00, 0xFC01, 0x7E00, 0x7FFF] if name == "float16" else
                            [0x7F81, 0x7FC0, 0xFFC1, 0x7FFF], dtype=torch.int32).to(torch.int16)
        values = torch.cat([values, nans.view(values.dtype)])
    held = values.numpy() if name != "bfloat16" else _bits(values).view(np.uint16)
    got, expected = to_float32(held, name), values.float()
    nan = expected.isnan().numpy()  # (torch widens a float16 NaN's payload one way or another by position)
    assert np.array_equal(got.view(np.uint32)[~nan], _bits(expected).view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all()


def test_quantize_casts_to_e4m3fn_as_torch_casts_it_on_every_rounding_edge():
    nans = torch.tensor([0xFFFFFFFF, 0xFFC00000, 0xFF800001, 0x7F800001, 0xFFFFF000], dtype=torch.int64)
    values = torch.cat([_edges(), nans.to(torch.int32).view(torch.float32)])  # the highest bit patterns too
    width = -(-len(values) // 128) * 128
    band = torch.cat([values, torch.zeros(width - len(values))]).reshape(1, width)
    got = quantize(band.numpy().copy(), "float32", np.ones(width // 128, np.float32), 128)
    assert np.array_equal(got, _bits(band.to(torch.float8_e4m3fn)))


def test_tile_scales_and_quantize_equal_torchs_block_computation_with_a_ragged_edge():
    gen = torch.Generator().manual_seed(1)
    band = (torch.randn(100, 300, generator=gen) * torch.logspace(-3, 2, 300)).to(torch.bfloat16)
    band[:, 128:256] = 0  # an all-zero tile: scale 0, values 0
    wide = band.float()
    amax = torch.nn.functional.pad(wide.abs().amax(dim=0), (0, 84)).reshape(3, 128).amax(dim=1)
    scales = amax / 448.0
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).repeat_interleave(128)[:300]
    expected = (wide / divisor).to(torch.float8_e4m3fn)
    held = _bits(band).view(np.uint16)
    got_scales = tile_scales(held, "bfloat16", 128)
    assert np.array_equal(got_scales.view(np.uint32), _bits(scales).view(np.uint32))
    assert np.array_equal(quantize(held, "bfloat16", got_scales, 128), _bits(expected))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize_of_a_box_off_the_tile_grid_equals_torchs_blockwise_product(dtype):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randint(0, 256, (300, 260), dtype=torch.uint8, generator=gen)
    scales = torch.rand(3, 3, generator=gen)
    full = weight.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[
        :300, :260]
    expected = full.to(getattr(torch, dtype))[70:290, 5:200]
    box = weight[70:290, 5:200].numpy().copy()
    got = dequantize(box, scales.numpy()[0:3, 0:2], (70, 5), 128, "float8_e4m3fn", dtype)
    nan = expected.float().isnan().numpy()
    assert np.array_equal(got.view(np.uint16 if dtype != "float32" else np.uint32)[~nan],
                          _bits(expected).view(got.view(np.uint16 if dtype != "float32" else np.uint32).dtype)[~nan])
    assert np.isnan(to_float32(got, dtype))[nan].all()


@pytest.mark.parametrize("src", ENCODES)
@pytest.mark.parametrize("dst", ENCODES)
def test_convert_between_floating_dtypes_gives_torchs_cast(src, dst):
    wide = torch.cat([_edges().double(), torch.randn(5000, dtype=torch.float64) * 1e5,
                      torch.tensor([1e300, -1e-300, 65520.0, 3.4e38, 1 + 2.0 ** -40], dtype=torch.float64)])
    values = wide.to(getattr(torch, src))
    held = values.numpy() if src != "bfloat16" else _bits(values).view(np.uint16)
    if src == "float32":
        held = held.view(np.uint32)
    got = convert(held, src, dst)
    expected = values.to(getattr(torch, dst))
    nan = expected.isnan().numpy()
    width = np.uint64 if dst == "float64" else np.uint32 if dst == "float32" else np.uint16
    assert np.array_equal(got.view(width)[~nan], _bits(expected).view(width)[~nan])
    assert np.isnan(to_float32(got, dst))[nan].all()
