"""Unit tests of bridge.reference.oracle.percentile: nearest-rank semantics."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from bridge.reference.oracle import percentile

values_lists = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=60)
int_lists = st.lists(st.integers(-1000, 1000), min_size=1, max_size=60)
# q/100 is exact in binary floating point for these, so the rank is exact whatever the arithmetic.
dyadic_q = st.integers(0, 8).map(lambda i: i * 12.5)


def reference(values: Sequence[float], q: float) -> float | None:
    """Nearest rank, in exact arithmetic: the smallest rank k with k/n >= q/100, clamped to 1..n."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    rank = math.ceil(Fraction(q) * n / 100)
    return ordered[min(max(rank, 1), n) - 1]


def test_empty_input_is_none() -> None:
    assert percentile([], 50) is None
    assert percentile([], 0) is None
    assert percentile((), 100) is None


@given(values_lists, dyadic_q)
def test_matches_reference_for_exact_quantiles(values: list[float], q: float) -> None:
    assert percentile(values, q) == reference(values, q)


@given(values_lists, st.floats(0, 100))
def test_matches_reference_away_from_rank_boundaries(values: list[float], q: float) -> None:
    exact = Fraction(q) * len(values) / 100
    # Where q/100*n is (almost) a whole number, see the exact-rank tests below.
    assume(abs(exact - round(exact)) > Fraction(1, 10**6))
    assert percentile(values, q) == reference(values, q)


@given(int_lists, st.integers(0, 100))
@example(list(range(1, 101)), 7)
def test_matches_reference_for_integer_quantiles(values: list[int], q: int) -> None:
    assert percentile(values, q) == reference(values, q)


def test_p7_of_one_to_hundred_is_seven() -> None:
    assert percentile(list(range(1, 101)), 7) == 7


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([15, 20, 35, 40, 50], 5, 15),
        ([15, 20, 35, 40, 50], 30, 20),
        ([15, 20, 35, 40, 50], 40, 20),
        ([15, 20, 35, 40, 50], 50, 35),
        ([15, 20, 35, 40, 50], 100, 50),
        ([3, 6, 7, 8, 8, 10, 13, 15, 16, 20], 25, 7),
        ([3, 6, 7, 8, 8, 10, 13, 15, 16, 20], 50, 8),
        ([3, 6, 7, 8, 8, 10, 13, 15, 16, 20], 75, 15),
        ([3, 6, 7, 8, 8, 10, 13, 15, 16, 20], 100, 20),
        (list(range(1, 101)), 50, 50),
        (list(range(1, 101)), 95, 95),
        (list(range(1, 101)), 99, 99),
        (list(range(1, 101)), 99.5, 100),
        (list(range(1, 21)), 95, 19),
    ],
)
def test_textbook_examples(values: list[int], q: float, expected: int) -> None:
    assert percentile(values, q) == expected


@given(values_lists, st.floats(0, 100))
def test_result_is_an_input_value_covering_q_percent(values: list[float], q: float) -> None:
    result = percentile(values, q)
    assert result in values
    assert result is not None
    at_or_below = sum(1 for v in values if v <= result)
    assert Fraction(at_or_below, len(values)) >= Fraction(q) / 100


@given(values_lists, st.floats(0, 100), st.randoms(use_true_random=False))
def test_order_of_input_does_not_matter(values: list[float], q: float, rnd: random.Random) -> None:
    shuffled = list(values)
    rnd.shuffle(shuffled)
    assert percentile(shuffled, q) == percentile(values, q)


@given(values_lists)
def test_extremes(values: list[float]) -> None:
    assert percentile(values, 0) == min(values)
    assert percentile(values, 100) == max(values)
    assert percentile(values, -10) == min(values)
    assert percentile(values, 250) == max(values)


@given(values_lists, st.floats(0, 100), st.floats(0, 100))
def test_monotonic_in_q(values: list[float], q1: float, q2: float) -> None:
    low, high = sorted((q1, q2))
    assert percentile(values, low) <= percentile(values, high)  # type: ignore[operator]


@given(st.floats(allow_nan=False), st.floats(0, 100))
def test_single_value(value: float, q: float) -> None:
    assert percentile([value], q) == value


def test_input_is_not_modified() -> None:
    values = [5.0, 1.0, 3.0]
    percentile(values, 50)
    assert values == [5.0, 1.0, 3.0]
