"""Unit tests of the phase table, the frozen routing hash, the poller's grace rule, the miss-rate bound and
the flag validation functions (no database)."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bridge.core.errors import FlagError, GateRefused
from bridge.core.phases import (
    BUCKETS,
    PHASES,
    ROUTE_OF_PHASE,
    FixedRouter,
    Flag,
    Phase,
    bucket,
    percent_threshold,
    poller_should_handle,
)
from bridge.flags.store import (
    validate_percent,
    validate_phase,
    validate_reason,
    validate_thresholds,
    validate_type_name,
)
from bridge.reconcile.classify import miss_rate_upper
from bridge.rollout.promotion import is_promotion

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)

# Two-decimal percentages: the only ones a flag can hold (validate_percent).
percents = st.integers(0, 10_000).map(lambda i: i / 100)
type_names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
instance_ids = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)


def _inside(workflow_type: str, percent: float, candidates: int = 500) -> tuple[str, str]:
    """One instance id inside ``percent`` and one outside, for ``workflow_type`` (found by the hash itself)."""
    threshold = percent_threshold(percent)
    ids = [f"inst-{n}" for n in range(candidates)]
    inside = next(i for i in ids if bucket(workflow_type, i) < threshold)
    outside = next(i for i in ids if bucket(workflow_type, i) >= threshold)
    return inside, outside


# --- the frozen hash ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("workflow_type", "instance_id", "expected"), [
    ("orders", "i-1", 2167),
    ("orders", "i-2", 152),
    ("reports", "r-7", 7865),
    ("etl", "demo-000001", 1515),
    ("", "x", 1280),
])
def test_bucket_values_are_pinned(workflow_type: str, instance_id: str, expected: int) -> None:
    """The hash is frozen: these values were computed when it shipped. Any change to the hash (another
    digest, separator, byte order, modulus) moves instances across a selective boundary and fails here."""
    assert bucket(workflow_type, instance_id) == expected


def test_bucket_of_no_type_is_the_empty_type() -> None:
    """A task without a workflow type hashes as the empty type (the SQL twin uses coalesce(type, ''))."""
    assert bucket(None, "x") == bucket("", "x") == 1280


@given(type_names, instance_ids)
def test_bucket_is_the_documented_md5_prefix(workflow_type: str, instance_id: str) -> None:
    """bucket = first 32 bits of md5(type + '/' + instance) mod 10,000, always within 0..9999."""
    digest = hashlib.md5(f"{workflow_type}/{instance_id}".encode()).digest()
    expected = int.from_bytes(digest[:4], "big") % BUCKETS
    value = bucket(workflow_type, instance_id)
    assert value == expected
    assert 0 <= value < BUCKETS


def test_bucket_spreads_instances_evenly() -> None:
    """Over 20,000 instances a 30% selective share takes close to 30% of them (the hash is not skewed)."""
    flag = Flag("orders", "selective", 30.0)
    inside = sum(flag.in_percentage(f"order-{n}") for n in range(20_000))
    assert 5_700 <= inside <= 6_300


@pytest.mark.parametrize(("percent", "threshold"), [
    (None, 10_000), (0.0, 0), (0.01, 1), (12.5, 1250), (33.33, 3333), (57.0, 5700), (100.0, 10_000),
])
def test_percent_threshold(percent: float | None, threshold: int) -> None:
    """The bucket threshold of a percentage is round(p * 100); no percentage means every instance."""
    assert percent_threshold(percent) == threshold


@given(st.lists(instance_ids, min_size=1, max_size=30), percents, percents)
@example(["i-1", "i-2"], 21.67, 21.68)  # bucket('orders', 'i-1') == 2167: right at the boundary
def test_raising_the_percentage_only_adds_instances(ids: list[str], a: float, b: float) -> None:
    """Monotone: every instance inside p is inside any p' >= p, so raising a canary never moves an
    instance back to the poller, and lowering it never adds one."""
    low, high = sorted((a, b))
    inside_low = {i for i in ids if Flag("orders", "selective", low).in_percentage(i)}
    inside_high = {i for i in ids if Flag("orders", "selective", high).in_percentage(i)}
    assert inside_low <= inside_high


def test_boundary_instance_enters_exactly_at_its_bucket() -> None:
    """bucket('orders','i-1') is 2167: outside at 21.67% (strictly below the threshold is inside), inside at 21.68%."""
    assert not Flag("orders", "selective", 21.67).in_percentage("i-1")
    assert Flag("orders", "selective", 21.68).in_percentage("i-1")
    assert not Flag("orders", "selective", 0.0).in_percentage("i-1")
    assert Flag("orders", "selective", 100.0).in_percentage("i-1")
    assert Flag("orders", "selective", None).in_percentage("i-1")


# --- the phase table ------------------------------------------------------------------------------

@pytest.mark.parametrize(("phase", "event", "poller"), [
    ("polling", "off", "authoritative"),
    ("dual_write", "shadow", "authoritative"),
    ("selective", "dispatch", "fallback"),  # no percentage: every instance is a canary
    ("cutover", "dispatch", "sweep"),
])
def test_phase_table_for_every_instance(phase: Phase, event: str, poller: str) -> None:
    """DESIGN.md's phase table, for a flag without a percentage, for any instance."""
    flag = Flag("orders", phase)
    for instance in ("i-1", "i-2", "x", ""):
        assert flag.event_route(instance) == event
        assert flag.poller_route(instance) == poller


def test_phase_table_covers_every_phase() -> None:
    """Every phase has an event route; nothing is left to a default."""
    assert set(ROUTE_OF_PHASE) == set(PHASES) == {"polling", "dual_write", "selective", "cutover"}


def test_selective_percentage_splits_the_instances() -> None:
    """selective p%: inside the percentage the event path dispatches and the poller is only the fallback;
    outside, the event path is off and the poller stays authoritative."""
    inside, outside = _inside("orders", 40.0)
    flag = Flag("orders", "selective", 40.0)
    assert (flag.event_route(inside), flag.poller_route(inside)) == ("dispatch", "fallback")
    assert (flag.event_route(outside), flag.poller_route(outside)) == ("off", "authoritative")


@given(instance_ids, percents)
def test_exactly_one_authoritative_path_per_selective_instance(instance_id: str, percent: float) -> None:
    """In selective, an instance is either the event path's (dispatch + poller fallback) or the poller's
    (authoritative + event path off): never both off, never both authoritative."""
    flag = Flag("orders", "selective", percent)
    routes = (flag.event_route(instance_id), flag.poller_route(instance_id))
    assert routes in {("dispatch", "fallback"), ("off", "authoritative")}
    assert (routes[0] == "dispatch") == flag.in_percentage(instance_id)


def test_percentage_ignored_outside_selective() -> None:
    """A percentage left on a flag in another phase does not split that phase."""
    inside, outside = _inside("orders", 10.0)
    others: tuple[Phase, ...] = ("polling", "dual_write", "cutover")
    for phase in others:
        flag = Flag("orders", phase, 10.0)
        assert flag.event_route(inside) == flag.event_route(outside) == ROUTE_OF_PHASE[phase]


def test_fixed_router() -> None:
    """FixedRouter answers the phase's route for every type; an unknown phase is refused."""
    assert FixedRouter("dual_write").event_route("anything", "i") == "shadow"
    assert FixedRouter("cutover").event_route(None, "i") == "dispatch"
    with pytest.raises(ValueError, match="unknown phase"):
        FixedRouter("everything")  # type: ignore[arg-type]


# --- the poller's grace rule ----------------------------------------------------------------------

@pytest.mark.parametrize("ready_since", [None, NOW, NOW - timedelta(hours=1)])
def test_poller_should_handle_by_phase(ready_since: datetime | None) -> None:
    """No flag, polling and dual_write: always; cutover: never (only the sweep); whatever the readiness age."""
    assert poller_should_handle(None, "i-1", ready_since, NOW)
    assert poller_should_handle(Flag("orders", "polling"), "i-1", ready_since, NOW)
    assert poller_should_handle(Flag("orders", "dual_write"), "i-1", ready_since, NOW)
    assert not poller_should_handle(Flag("orders", "cutover"), "i-1", ready_since, NOW)


def test_poller_should_handle_selective_grace() -> None:
    """selective: an instance outside the percentage at once; a canary only once ready at least the grace."""
    inside, outside = _inside("orders", 50.0)
    flag = Flag("orders", "selective", 50.0, grace_seconds=5.0)
    just_ready = NOW - timedelta(seconds=4.999)
    at_grace = NOW - timedelta(seconds=5)
    assert poller_should_handle(flag, outside, just_ready, NOW)
    assert not poller_should_handle(flag, inside, just_ready, NOW)
    assert not poller_should_handle(flag, inside, NOW, NOW)
    assert poller_should_handle(flag, inside, at_grace, NOW)
    assert poller_should_handle(flag, inside, NOW - timedelta(minutes=1), NOW)
    assert poller_should_handle(flag, inside, None, NOW)  # nothing records readiness: never held back forever


@given(st.floats(0.01, 600), st.floats(-10, 1200))
def test_canary_waits_exactly_the_grace(grace: float, age: float) -> None:
    """For a canary instance the poller acts iff the task has been ready for at least the grace period."""
    flag = Flag("orders", "selective", None, grace_seconds=grace)
    ready = NOW - timedelta(seconds=age)
    expected = ready <= NOW - timedelta(seconds=grace)
    assert poller_should_handle(flag, "any", ready, NOW) is expected


# --- the miss-rate bound --------------------------------------------------------------------------

def _binom_cdf(k: int, n: int, p: float) -> float:
    return math.fsum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def test_zero_misses_in_thirty_is_not_a_zero_rate() -> None:
    """0 misses in 30 tasks: the 95% upper bound is 1 - 0.05**(1/30) ~ 9.5%, not 0."""
    assert miss_rate_upper(0, 30) == pytest.approx(0.0950339, abs=1e-6)
    assert miss_rate_upper(0, 30) == pytest.approx(1 - 0.05 ** (1 / 30), rel=1e-12)


def test_a_tenth_of_a_percent_budget_needs_about_three_thousand_clean_tasks() -> None:
    """At 95%, 0 in 2,995 is (just) below 0.1% and 0 in 2,990 is not."""
    assert miss_rate_upper(0, 2995) < 0.001 < miss_rate_upper(0, 2990)


@pytest.mark.parametrize(("misses", "n", "confidence", "expected"), [
    (1, 100, 0.95, 0.0465598),   # the textbook value
    (3, 1000, 0.95, 0.0077352),
    (2, 20, 0.95, 0.2826185),
    (10, 50, 0.95, 0.3155961),
    (1, 100, 0.99, 0.0645427),
])
def test_known_clopper_pearson_values(misses: int, n: int, confidence: float, expected: float) -> None:
    """Matches the exact one-sided Clopper-Pearson bound (Beta(k+1, n-k) quantile, computed independently)."""
    assert miss_rate_upper(misses, n, confidence) == pytest.approx(expected, abs=2e-7)


@pytest.mark.parametrize(("misses", "n"), [(0, 0), (0, -3), (5, 5), (7, 5)])
def test_no_evidence_or_all_misses_is_a_bound_of_one(misses: int, n: int) -> None:
    """Without tasks, or when every task missed, nothing bounds the rate below 1."""
    assert miss_rate_upper(misses, n) == 1.0


@settings(max_examples=60)
@given(st.integers(1, 150).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))))
def test_bound_satisfies_its_definition(case: tuple[int, int]) -> None:
    """The upper bound p is where P(X <= misses; n, p) equals alpha: above it the data would be too unlikely."""
    misses, n = case
    upper = miss_rate_upper(misses, n)
    assert misses / n < upper < 1
    assert _binom_cdf(misses, n, upper) == pytest.approx(0.05, abs=1e-6)
    assert _binom_cdf(misses, n, upper * 0.99) > 0.05


@settings(max_examples=60)
@given(st.integers(2, 3000).flatmap(lambda n: st.tuples(st.integers(0, min(n - 2, 60)), st.just(n))))
def test_bound_rises_with_misses_and_falls_with_tasks(case: tuple[int, int]) -> None:
    """One more miss never lowers the bound; one more clean task never raises it."""
    misses, n = case
    assert miss_rate_upper(misses + 1, n) > miss_rate_upper(misses, n)
    assert miss_rate_upper(misses, n + 1) < miss_rate_upper(misses, n)


@settings(max_examples=60)
@given(st.integers(0, 50), st.integers(51, 400))
def test_higher_confidence_is_a_higher_bound(misses: int, n: int) -> None:
    """A 99% bound is above the 95% one for the same evidence."""
    assert miss_rate_upper(misses, n, 0.99) > miss_rate_upper(misses, n, 0.95)


# --- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["orders", "a", "Orders2", "a.b:c/d@e+f-g_h", "9lives", "x" * 200])
def test_valid_type_names(name: str) -> None:
    assert validate_type_name(name) == name


@pytest.mark.parametrize("bad", ["", " orders", "orders ", "a b", "-x", "_x", ".x", "x" * 201, "a;b", "o'rders",
                                 'o"rders', "ordérs", "a\nb", None, 5])
def test_invalid_type_names_are_refused(bad: Any) -> None:
    """Type names are letters, digits and _ . : / @ + -, 1-200 characters, starting with a letter or digit."""
    with pytest.raises(FlagError, match="invalid workflow type name") as info:
        validate_type_name(bad)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("bad", ["orders\n", "x" * 199 + "\n"], ids=["orders-newline", "199-chars-newline"])
def test_type_name_with_a_trailing_newline_is_refused(bad: str) -> None:
    """A trailing newline is not part of a valid name: it would store a flag no task's type ever equals."""
    with pytest.raises(FlagError, match="invalid workflow type name"):
        validate_type_name(bad)


@pytest.mark.parametrize("phase", PHASES)
def test_valid_phases(phase: str) -> None:
    assert validate_phase(phase) == phase


@pytest.mark.parametrize("bad", ["", "Polling", "cut-over", "dual-write", "rollback", "selective "])
def test_unknown_phases_are_refused(bad: str) -> None:
    with pytest.raises(FlagError, match="unknown phase"):
        validate_phase(bad)


@pytest.mark.parametrize(("percent", "expected"), [(None, None), (0, 0.0), (12.34, 12.34), (50, 50.0), (100, 100.0)])
def test_valid_percentages(percent: float | None, expected: float | None) -> None:
    value = validate_percent(percent, "selective")
    assert value == expected
    assert value is None or type(value) is float


@pytest.mark.parametrize("bad", [150, 100.01, -1, -0.01, math.nan, math.inf, -math.inf, True, 12.345, "50"])
def test_invalid_percentages_are_refused(bad: Any) -> None:
    """0..100, finite, a number (not a bool), at most two decimals (the hash has 10,000 buckets)."""
    with pytest.raises(FlagError):
        validate_percent(bad, "selective")


@pytest.mark.parametrize("phase", ["polling", "dual_write", "cutover"])
def test_percent_outside_selective_is_refused(phase: str) -> None:
    with pytest.raises(FlagError, match="selective phase only"):
        validate_percent(10, phase)
    assert validate_percent(None, phase) is None


def test_reasons() -> None:
    """A reason is required (not blank), stripped, at most 2,000 characters; the actor check reuses it."""
    assert validate_reason("  canary looks fine \n") == "canary looks fine"
    assert validate_reason("r" * 2000) == "r" * 2000
    for bad in (None, "", "   ", "\n\t"):
        with pytest.raises(FlagError, match="reason is required"):
            validate_reason(bad)
    with pytest.raises(FlagError, match="too long"):
        validate_reason("r" * 2001)
    with pytest.raises(FlagError, match="actor is required"):
        validate_reason("", "actor")


def test_thresholds() -> None:
    """Known names only, positive finite numbers, rates below 1; values come back as floats."""
    assert validate_thresholds({"min_tasks": 20, "miss_budget": 0.01}) == {"min_tasks": 20.0, "miss_budget": 0.01}
    bad_inputs: list[dict[str, Any]] = [
        {"min_task": 5}, {"min_tasks": 0}, {"min_tasks": -1}, {"objective": math.nan}, {"tolerance": math.inf},
        {"min_tasks": True}, {"min_tasks": "5"}, {"miss_budget": 1}, {"max_miss_rate": 1.5},
    ]
    for bad in bad_inputs:
        with pytest.raises(FlagError):
            validate_thresholds(bad)


def test_error_exit_codes() -> None:
    """Bad input is a usage error (2); a refused gate is a failed check (1)."""
    assert FlagError.exit_code == 2
    assert GateRefused.exit_code == 1


# --- what counts as a promotion -------------------------------------------------------------------

@pytest.mark.parametrize(("old", "target", "percent", "expected"), [
    (Flag("t"), "dual_write", None, True),
    (Flag("t", "dual_write"), "selective", 10.0, True),
    (Flag("t", "selective", 10.0), "cutover", None, True),
    (Flag("t", "polling"), "cutover", None, True),
    (Flag("t", "selective", 10.0), "selective", 50.0, True),
    (Flag("t", "selective", 50.0), "selective", None, True),   # no percentage = 100%
    (Flag("t", "selective", 50.0), "selective", 10.0, False),
    (Flag("t", "selective", None), "selective", 99.99, False),
    (Flag("t", "selective", 50.0), "selective", 50.0, False),
    (Flag("t", "cutover"), "selective", 10.0, False),
    (Flag("t", "cutover"), "polling", None, False),
    (Flag("t", "dual_write"), "dual_write", None, False),
])
def test_is_promotion(old: Flag, target: Phase, percent: float | None, expected: bool) -> None:
    """Moving up the phase order, or raising a selective share, is a promotion (gated); anything else is not."""
    assert is_promotion(old, target, percent) is expected


@settings(max_examples=200)
@given(phase=st.sampled_from(["polling", "dual_write", "selective", "cutover"]),
       percent=st.one_of(st.none(), st.floats(0, 100)), ids=st.lists(st.text(min_size=1, max_size=12), min_size=1,
                                                                  max_size=20))
def test_a_uniform_route_is_every_instances_route(phase: Any, percent: float | None, ids: list[str]) -> None:
    """``Flag.uniform_event_route`` (the evaluator's one-statement dispatch asks it once per type): when it
    names a route, that is the route of every instance; it is None only for a selective percentage below 100."""
    flag = Flag("orders", phase, percent=percent if phase == "selective" else None)
    uniform = flag.uniform_event_route()
    if uniform is not None:
        assert all(flag.event_route(i) == uniform for i in ids)
    else:
        assert phase == "selective" and percent_threshold(percent) < BUCKETS
