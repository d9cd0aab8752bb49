"""fasthorovod.units: the one rule for sizes and rates, and errors that name the bad text."""
import argparse

import pytest

from fasthorovod.units import (
    BYTES_FORMS,
    RATE_FORMS,
    bytes_argument,
    format_bytes,
    format_rate,
    parse_bytes,
    parse_rate,
    rate_argument,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("4096B", 4096),
        ("4096 b", 4096),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        ("16MiB", 16 << 20),
        ("1GiB", 1 << 30),
        ("2TiB", 2 << 40),
        ("1kB", 1000),
        ("1KB", 1000),
        ("64MB", 64 * 10**6),
        ("1GB", 10**9),
        ("1TB", 10**12),
        ("1.5MiB", 3 << 19),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("  8 MiB  ", 8 << 20),
    ],
)
def test_byte_counts(text, expected):
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1M", "byte count '1M' is ambiguous: write 1MiB (x1048576) or 1MB (x1000000)"),
        ("64k", "byte count '64k' is ambiguous: write 64KiB (x1024) or 64kB (x1000)"),
        ("2G", "byte count '2G' is ambiguous: write 2GiB (x1073741824) or 2GB (x1000000000)"),
        ("12 parsecs", "byte count '12 parsecs' has unknown unit 'parsecs'; write " + BYTES_FORMS),
        ("200mbit", "byte count '200mbit' has unknown unit 'mbit' (rates are not byte counts)"),
        ("1.3B", "byte count '1.3B' is not a whole number of bytes (1.3)"),
        ("-1", "byte count '-1' is not " + BYTES_FORMS),
        ("", "byte count '' is not " + BYTES_FORMS),
        ("MiB", "byte count 'MiB' is not " + BYTES_FORMS),
        ("1e6", "byte count '1e6' is not " + BYTES_FORMS),
    ],
)
def test_bad_byte_counts_are_refused_naming_the_text(text, message):
    with pytest.raises(ValueError) as error:
        parse_bytes(text)
    assert str(error.value).startswith(message), str(error.value)


def test_the_accepted_forms_are_named():
    assert "KiB" in BYTES_FORMS and "1024^n" in BYTES_FORMS and "kB" in BYTES_FORMS and "1000^n" in BYTES_FORMS
    assert "mbit" in RATE_FORMS and "1000^n" in RATE_FORMS
    with pytest.raises(ValueError, match="is not text"):
        parse_bytes(4096)


@pytest.mark.parametrize("nbytes", [0, 1, 1000, 4096, 65536, 3 << 19, 1 << 30, 5 << 40, 10**9])
def test_format_bytes_reads_back(nbytes):
    assert parse_bytes(format_bytes(nbytes)) == nbytes


def test_format_bytes_spellings():
    assert [format_bytes(n) for n in (65536, 1000, 1 << 20, 3 << 19, 1 << 40)] == \
        ["64KiB", "1000B", "1MiB", "1536KiB", "1TiB"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("200mbit", 2e8), ("1gbit", 1e9), ("1Gbit", 1e9), ("1.5gbit", 1.5e9), ("64000", 64000.0),
     ("999bit", 999.0), ("64kbit", 64e3), ("1tbit", 1e12), (" 25 gbit ", 25e9)],
)
def test_rates(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("100mbps", "rate '100mbps' has unknown unit 'mbps' (tc's *bps units are bytes/s; write bit/s: kbit, mbit, gbit)"),
        ("1furlong", "rate '1furlong' has unknown unit 'furlong'; write " + RATE_FORMS),
        ("1MiB", "rate '1MiB' has unknown unit 'mib'"),
        ("0mbit", "rate '0mbit' must be greater than zero"),
        ("fast", "rate 'fast' is not " + RATE_FORMS),
        ("-5mbit", "rate '-5mbit' is not " + RATE_FORMS),
    ],
)
def test_bad_rates_are_refused_naming_the_text(text, message):
    with pytest.raises(ValueError) as error:
        parse_rate(text)
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize("text", ["1gbit", "200mbit", "1500mbit", "64kbit", "999bit", "2tbit"])
def test_format_rate_reads_back(text):
    assert format_rate(parse_rate(text)) == text


def test_argparse_shows_the_message():
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--size", type=bytes_argument)
    parser.add_argument("--rate", type=rate_argument)
    assert vars(parser.parse_args(["--size", "64KiB", "--rate", "1gbit"])) == {"size": 65536, "rate": 1e9}
    with pytest.raises(argparse.ArgumentError, match="argument --size: byte count '1M' is ambiguous"):
        parser.parse_args(["--size", "1M"])
    with pytest.raises(argparse.ArgumentError, match="argument --rate: rate '1mbps' has unknown unit"):
        parser.parse_args(["--rate", "1mbps"])
