"""LSN: PostgreSQL's X/Y text form, round trips, ordering and bad input."""

from __future__ import annotations

import struct

import pytest

from applier.lsn import INVALID_LSN, LSN


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0/0", 0),
        ("0/1", 1),
        ("1/0", 1 << 32),
        ("16/B374D848", (0x16 << 32) | 0xB374D848),
        ("FFFFFFFF/FFFFFFFF", 0xFFFFFFFFFFFFFFFF),
    ],
)
def test_parse_print_round_trip(text: str, value: int) -> None:
    lsn = LSN.parse(text)
    assert lsn == value
    assert isinstance(lsn, LSN)
    assert str(lsn) == text
    assert LSN(text) == lsn
    assert LSN(value) == lsn
    assert str(LSN(value)) == text
    assert repr(lsn) == f"LSN('{text}')"
    assert LSN.parse(str(lsn)) == lsn


def test_lowercase_and_leading_zeros_parse_but_print_canonically() -> None:
    assert str(LSN.parse("16/b374d848")) == "16/B374D848"
    assert str(LSN.parse("00000016/0000000A")) == "16/A"


def test_ordering_and_hashing() -> None:
    texts = ["0/0", "0/FFFFFFFF", "1/0", "1/1", "16/B374D848", "FFFFFFFF/FFFFFFFF"]
    lsns = [LSN(t) for t in texts]
    assert sorted(reversed(lsns)) == lsns
    # The high half dominates: 0/FFFFFFFF < 1/0, unlike a string comparison of "F..." vs "1".
    assert LSN("0/FFFFFFFF") < LSN("1/0")
    assert LSN("9/0") < LSN("A/0") < LSN("10/0")
    assert max(lsns) == LSN("FFFFFFFF/FFFFFFFF")
    assert len({LSN("16/B374D848"), LSN((0x16 << 32) | 0xB374D848)}) == 1
    assert LSN("1/0") == 1 << 32
    assert INVALID_LSN == 0 and str(INVALID_LSN) == "0/0"


def test_packs_like_an_int() -> None:
    lsn = LSN("16/B374D848")
    assert struct.pack(">Q", lsn) == bytes.fromhex("00000016B374D848")
    assert LSN(struct.unpack(">Q", struct.pack(">Q", lsn))[0]) == lsn


@pytest.mark.parametrize(
    "bad",
    ["", "/", "0", "0/", "/0", "0/0/0", "G/0", "0/G", "123456789/0", "0/123456789", "-1/0", "0x1/0",
     "1 /0", "1/ 0", "0_0/0", "+1/0", "１/0"],
)
def test_bad_text_raises_value_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        LSN.parse(bad)
    assert repr(bad) in str(excinfo.value)
    with pytest.raises(ValueError):
        LSN(bad)


@pytest.mark.parametrize("bad", [-1, 1 << 64, -(1 << 63)])
def test_out_of_range_int_raises_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        LSN(bad)
