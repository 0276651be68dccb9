"""zerotrain.fmt: one spelling of byte sizes, counts and durations (see [Note: which prefixes])."""

from __future__ import annotations

import pytest

from zerotrain import fmt


@pytest.mark.parametrize(
    ("args", "kwargs", "text"),
    [
        ((1.5e9, "B"), {}, "1.50 GB"),
        ((512, "B"), {}, "512 B"),
        ((0, "B"), {}, "0 B"),
        ((197_120,), {}, "197.12 K"),
        ((2.6667,), {}, "2.67"),
        ((3e12, "FLOP/s"), {}, "3.00 TFLOP/s"),
        ((3.5e8, "B"), {"prefix": "G"}, "0.35 GB"),
        ((3 * 2**30, "B"), {"prefix": "Gi"}, "3.00 GiB"),
        ((1536 * 2**20, "B"), {"binary": True, "digits": 1}, "1.5 GiB"),
    ],
)
def test_quantity(args, kwargs, text):
    assert fmt.quantity(*args, **kwargs) == text


@pytest.mark.parametrize(
    ("value", "text"), [(6.74e9, "6.74B"), (350e6, "350.00M"), (1.2e12, "1.20T"), (512, "512")]
)
def test_count_writes_model_sizes(value, text):
    assert fmt.count(value) == text


def test_scaled_and_duration():
    assert fmt.scaled(3 * fmt.GiB, "Gi") == "3.00" and fmt.scaled(1234, "K", 1) == "1.2"
    assert [fmt.duration(s) for s in (2.5, 0.0123, 4e-6)] == ["2.50 s", "12.30 ms", "4.00 us"]
    assert [fmt.clock(s) for s in (0.4, 75, 3725, 90000)] == ["0:00", "1:15", "1:02:05", "25:00:00"]


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000000", 10**6), ("5gb", 5 * 10**9), ("1.5KiB", 1536), ("300 KB", 300_000), ("0", 0)],
)
def test_parse_size(text, size):
    assert fmt.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "5XB", "-1GB", "inf", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="is not a size"):
        fmt.parse_size(text)
