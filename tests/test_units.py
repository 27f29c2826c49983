"""Sizes: :func:`parse_size` against pydantic's ``ByteSize``, and the one byte formatter.

We keep our own parser because ``ByteSize`` (pydantic 2) differs where our inputs need it; where both
accept a size they agree byte for byte (the property test). The differences are asserted one by one:
if pydantic ever matches our semantics, the test fails and tells us to switch.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ByteSize, TypeAdapter, ValidationError

import aidaptiv_ds
from aidaptiv_ds.units import format_bytes, parse_size

BYTESIZE = TypeAdapter(ByteSize)
UNITS = ["", "b", "B", "k", "K", "kb", "KB", "kib", "KiB", "M", "MB", "MiB", "g", "GB", "GiB", "gib", "T", "TB", "TiB",
         "P", "PB", "PiB"]


@given(number=st.one_of(st.integers(0, 10**6), st.decimals(0, 10**4, places=2).map(str)),
       unit=st.sampled_from(UNITS), space=st.sampled_from(["", " "]))
def test_parse_size_equals_pydantic_bytesize_where_both_accept(number, unit, space):
    """KB = 1000, KiB = 1024 ... in both: the unit arithmetic is the same."""
    text = f"{number}{space}{unit}"
    assert parse_size(text, "x") == int(BYTESIZE.validate_python(text))


@pytest.mark.parametrize("value, ours, why", [
    ("5e10", 5 * 10**10, "scientific notation: `--dram_budget 5e10`, `--cache 2e12` (ByteSize refuses it)"),
    ("1.5e3KiB", 1536000, "scientific notation with a unit"),
    (1.5e9, 1_500_000_000, "a JSON float with no fraction of a byte works in both"),
])
def test_what_we_accept_and_bytesize_refuses(value, ours, why):
    assert parse_size(value, "aidaptiv.dram_budget") == ours, why
    if isinstance(value, str):
        with pytest.raises(ValidationError):
            BYTESIZE.validate_python(value)


@pytest.mark.parametrize("value, bytesize_gives, why", [
    (True, 1, '"dram_budget": true is a mistake, not 1 byte'),
    (False, 0, '"dram_budget": false is a mistake, not 0 bytes'),
    ("1EB", 10**18, "no drive or host is measured in exabytes; a typo for 1GB more likely"),
])
def test_what_bytesize_accepts_and_we_refuse_with_the_field_and_the_fix(value, bytesize_gives, why):
    assert int(BYTESIZE.validate_python(value)) == bytesize_gives
    with pytest.raises(aidaptiv_ds.AidaptivConfigError, match="aidaptiv.dram_budget: .* (is not a size|give)"):
        parse_size(value, "aidaptiv.dram_budget")


def test_bytesize_errors_do_not_name_our_field_or_the_fix():
    with pytest.raises(ValidationError) as e:
        BYTESIZE.validate_python("8 parsecs")
    assert "aidaptiv" not in str(e.value) and "KiB" not in str(e.value)
    with pytest.raises(aidaptiv_ds.AidaptivConfigError) as ours:
        parse_size("8 parsecs", "aidaptiv.dram_budget")
    assert "aidaptiv.dram_budget" in str(ours.value) and "KiB/MiB/GiB/TiB = 1024^n" in str(ours.value)


@pytest.mark.parametrize("n, binary, decimal", [
    (0, "0 B", "0 B"), (999, "999 B", "999 B"), (1000, "1000 B", "1.00 KB"), (1536, "1.50 KiB", "1.54 KB"),
    (8 * 2**30, "8.00 GiB", "8.59 GB"), (8 * 10**12, "7.28 TiB", "8.00 TB"), (3 * 2**50, "3.00 PiB", "3.38 PB"),
    (2**70, "1048576.00 PiB", "1180591.62 PB"),
])
def test_format_bytes_binary_and_decimal(n, binary, decimal):
    assert format_bytes(n) == binary and format_bytes(n, decimal=True) == decimal


@given(st.integers(0, 2**60), st.booleans())
def test_format_bytes_reads_back_within_its_precision(n, decimal):
    text = format_bytes(n, decimal=decimal)
    back = parse_size(text.replace(" ", ""), "x")
    # two decimals round to within half a hundredth of the unit (<= 0.005 n, the unit being <= n), and
    # parse_size reads back whole bytes (up to 1 more): 1111 B -> "1.08 KiB" -> 1105 is 6 B off
    assert abs(back - n) <= 0.005 * n + 1, (n, text, back)
