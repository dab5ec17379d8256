"""Every record decoder the SSD tier may use expands a compressed record to the exact raw bytes, and each
refuses a damaged or foreign record. The C one is what record_decoder() picks wherever a C compiler is found,
numpy's where none is (never the GPU's: the SSD tier's threads issue no CUDA work)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import codec_samples as S
from bigmoe_pager.codec import CodecError, encode_record
from bigmoe_pager.codec import format as F
from bigmoe_pager.codec.host_decoder import HostDecoder
from bigmoe_pager.codec.record_decoder import ReferenceDecoder, record_decoder
from bigmoe_pager.core.layout import ExpertLayout

LAYOUT = ExpertLayout.for_moe(128, 128, torch.float8_e4m3fn, 128)  # FP8 weights (coded) and float32 scales (raw)
OTHER = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, 128)


@pytest.fixture(params=["reference", "host"])
def decoder(request):
    return HostDecoder(LAYOUT) if request.param == "host" else ReferenceDecoder()


@pytest.fixture(scope="module")
def sample():
    raw = S.pattern_record(LAYOUT, "student_t", np.random.default_rng(7))
    return raw, np.frombuffer(encode_record(raw, LAYOUT), np.uint8).copy()


def test_decoded_record_equals_the_raw_record(decoder, sample):
    raw, coded = sample
    assert coded.size < raw.size, "the sample should compress"
    dst = torch.full((LAYOUT.pitch,), 0xA5, dtype=torch.uint8)
    decoder.decode_into(torch.from_numpy(coded), LAYOUT, dst)
    assert np.array_equal(dst[: LAYOUT.record_bytes].numpy(), raw)


def damaged(coded: np.ndarray, damage: str) -> np.ndarray:
    if damage == "magic":
        bad = coded.copy()
        bad[: len(F.MAGIC)] = np.frombuffer(b"XXXX", np.uint8)
        return bad
    # a record of another layout (cut to this one's length), offered as this layout's
    other = S.pattern_record(OTHER, "gaussian", np.random.default_rng(8))
    return np.frombuffer(encode_record(other, OTHER), np.uint8)[: coded.size].copy()


@pytest.mark.parametrize("damage", ["magic", "foreign"])
def test_damaged_or_foreign_record_is_refused(decoder, sample, damage):
    bad = damaged(sample[1], damage)
    with pytest.raises(CodecError):
        decoder.decode_into(torch.from_numpy(bad), LAYOUT, torch.zeros(LAYOUT.pitch, dtype=torch.uint8))


def test_record_decoder_picks_the_c_decoder_and_falls_back_without_a_compiler(monkeypatch, tmp_path):
    assert isinstance(record_decoder(LAYOUT), HostDecoder)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("BIGMOE_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
    fallback = record_decoder(LAYOUT)
    assert isinstance(fallback, ReferenceDecoder)
