"""The order a batch's events go out in (:func:`bridge.capture.triggers.loud_first`)."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from bridge.capture.triggers import loud_first


class Row(NamedTuple):
    n: int
    instance_id: str


@given(st.lists(st.sampled_from("abcdef"), max_size=30), st.sets(st.sampled_from("abcdefg")))
def test_loud_instances_go_first_and_every_instance_keeps_its_order(instances: list[str], loud: set[str]) -> None:
    rows = [Row(n, i) for n, i in enumerate(instances)]
    out = loud_first(rows, loud)
    assert sorted(out) == rows  # nothing lost or doubled
    for instance in set(instances):  # one instance's rows in their order
        assert [r for r in out if r.instance_id == instance] == [r for r in rows if r.instance_id == instance]
    flags = [r.instance_id in loud for r in out]
    assert flags == sorted(flags, reverse=True)  # every loud instance's rows before any quiet-only one's
    if not loud & set(instances) or set(instances) <= loud:
        assert out == rows  # nothing to move
