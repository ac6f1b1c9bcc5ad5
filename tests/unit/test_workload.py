"""Unit tests of bridge.reference.workload: cycle detection, DAG validation, DAG shapes, the demo workload."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.core.errors import PollbridgeError, WorkloadError
from bridge.reference.workload import SHAPES, TaskSpec, demo_workload, find_cycle, make_shape, validate_dag


def _is_acyclic(deps: Mapping[str, Sequence[str]]) -> bool:
    """Reference check (Kahn's algorithm), independent of find_cycle."""
    remaining = {key: set(wanted) for key, wanted in deps.items()}
    while remaining:
        ready = [key for key, wanted in remaining.items() if not wanted & remaining.keys()]
        if not ready:
            return False
        for key in ready:
            del remaining[key]
    return True


def _assert_real_cycle(cycle: list[str], deps: Mapping[str, Sequence[str]]) -> None:
    assert len(cycle) >= 2
    assert cycle[0] == cycle[-1]
    assert len(set(cycle[:-1])) == len(cycle) - 1  # a simple cycle: no key repeated inside
    for node, dep in pairwise(cycle):
        assert dep in deps[node], f"{node} -> {dep} is not an edge"


@st.composite
def dags(draw: st.DrawFn, min_size: int = 1) -> dict[str, list[str]]:
    """A random DAG: task i may depend only on tasks with a lower index; keys inserted in random order."""
    n = draw(st.integers(min_size, 25))
    keys = [f"k{i}" for i in range(n)]
    deps = {
        keys[i]: [keys[j] for j in draw(st.lists(st.integers(0, i - 1), max_size=4, unique=True))] if i else []
        for i in range(n)
    }
    order = draw(st.permutations(keys))
    return {key: deps[key] for key in order}


# --------------------------------------------------------------------------------------------------
# find_cycle / validate_dag


@given(dags())
def test_find_cycle_is_none_for_dags(deps: dict[str, list[str]]) -> None:
    assert _is_acyclic(deps)  # the generator really makes DAGs
    assert find_cycle(deps) is None
    validate_dag("inst", deps)


def test_find_cycle_empty() -> None:
    assert find_cycle({}) is None
    validate_dag("inst", {})


@settings(max_examples=100)
@given(data=st.data())
def test_find_cycle_finds_a_planted_back_edge(data: st.DataObject) -> None:
    deps = data.draw(dags(min_size=1), label="dag")
    keys = sorted(deps, key=lambda k: int(k[1:]))
    # A descending path i0 > i1 > ... > ik (forward edges, as the DAG has), then the back edge ik -> i0.
    path = data.draw(
        st.lists(st.sampled_from(range(len(keys))), min_size=1, max_size=5, unique=True).map(
            lambda xs: sorted(xs, reverse=True)
        ),
        label="path",
    )
    for higher, lower in pairwise(path):
        if keys[lower] not in deps[keys[higher]]:
            deps[keys[higher]].append(keys[lower])
    deps[keys[path[-1]]].append(keys[path[0]])  # the back edge (a self-loop when the path has one key)
    assert not _is_acyclic(deps)

    cycle = find_cycle(deps)
    assert cycle is not None
    _assert_real_cycle(cycle, deps)
    with pytest.raises(WorkloadError, match="dependency cycle"):
        validate_dag("inst", deps)


def test_find_cycle_self_loop() -> None:
    assert find_cycle({"a": ["a"]}) == ["a", "a"]


def test_find_cycle_reports_only_the_cycle_not_the_path_to_it() -> None:
    deps = {"entry": ["x"], "x": ["y"], "y": ["z"], "z": ["x"]}
    cycle = find_cycle(deps)
    assert cycle is not None
    _assert_real_cycle(cycle, deps)
    assert "entry" not in cycle
    assert set(cycle) == {"x", "y", "z"}


def test_find_cycle_ignores_unknown_keys() -> None:
    assert find_cycle({"a": ["missing"], "b": ["a"]}) is None


def test_find_cycle_handles_deep_chains_iteratively() -> None:
    n = 5000  # deeper than the default recursion limit
    deps = {f"t{i}": [f"t{i - 1}"] if i else [] for i in range(n)}
    assert find_cycle(deps) is None
    deps["t0"] = [f"t{n - 1}"]
    cycle = find_cycle(deps)
    assert cycle is not None
    assert len(cycle) == n + 1
    _assert_real_cycle(cycle, deps)


def test_validate_dag_names_the_cycle() -> None:
    with pytest.raises(WorkloadError) as info:
        validate_dag("inst-7", {"a": ["b"], "b": ["c"], "c": ["a"]})
    message = str(info.value)
    assert "'inst-7'" in message
    assert re.search(r"cycle (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)$", message), message


@given(dags(), st.text(min_size=1))
def test_validate_dag_names_the_unknown_key(deps: dict[str, list[str]], unknown: str) -> None:
    if unknown in deps:
        unknown = unknown + "_missing"  # keys are k<digits>: this one is not
    victim = next(iter(deps))
    deps[victim] = [*deps[victim], unknown]
    with pytest.raises(WorkloadError) as info:
        validate_dag("inst-1", deps)
    message = str(info.value)
    assert repr(unknown) in message
    assert repr(victim) in message
    assert "'inst-1'" in message
    assert "unknown task key" in message


def test_unknown_key_is_reported_even_with_a_cycle() -> None:
    with pytest.raises(WorkloadError, match="unknown task key 'ghost'"):
        validate_dag("i", {"a": ["b"], "b": ["a", "ghost"]})


def test_workload_error_is_a_pollbridge_error() -> None:
    assert issubclass(WorkloadError, PollbridgeError)


# --------------------------------------------------------------------------------------------------
# make_shape


def _deps_of(tasks: Sequence[TaskSpec]) -> dict[str, tuple[str, ...]]:
    return {t.key: t.depends_on for t in tasks}


def _expected_len(shape: str, size: int) -> int:
    size = max(size, 1)
    if shape == "chain":
        return size
    if shape == "fanout":
        return max(size, 3)
    return 1 + 3 * -(-(size - 1) // 3)  # diamond: 1 + 3k, the smallest such >= size


@settings(max_examples=60)
@given(st.sampled_from(SHAPES), st.integers(-2, 80), st.integers(0, 2**32))
def test_make_shape_is_a_valid_dag_of_about_the_requested_size(shape: str, size: int, seed: int) -> None:
    tasks = make_shape(shape, size, random.Random(seed))
    keys = [t.key for t in tasks]
    assert len(keys) == len(set(keys))  # keys are unique
    deps = _deps_of(tasks)
    for task in tasks:
        assert set(task.depends_on) <= set(keys)
        assert len(task.depends_on) == len(set(task.depends_on))
    assert _is_acyclic(deps)
    assert find_cycle(deps) is None
    validate_dag("inst", deps)
    assert len(tasks) == _expected_len(shape, size)
    assert max(size, 1) <= len(tasks) <= max(size, 3) + 2
    # One root and one sink: every task is reachable from the start and reaches the end.
    roots = [t.key for t in tasks if not t.depends_on]
    used = {d for t in tasks for d in t.depends_on}
    sinks = [k for k in keys if k not in used]
    assert len(roots) == 1
    assert len(sinks) == 1


def test_chain_shape() -> None:
    tasks = make_shape("chain", 4, random.Random(1))
    assert _deps_of(tasks) == {"t0": (), "t1": ("t0",), "t2": ("t1",), "t3": ("t2",)}


def test_fanout_shape() -> None:
    tasks = make_shape("fanout", 5, random.Random(1))
    assert _deps_of(tasks) == {
        "start": (), "branch0": ("start",), "branch1": ("start",), "branch2": ("start",),
        "join": ("branch0", "branch1", "branch2"),
    }


def test_diamond_shape() -> None:
    tasks = make_shape("diamond", 7, random.Random(1))
    assert _deps_of(tasks) == {
        "n0": (), "n1": ("n0",), "n2": ("n0",), "n3": ("n1", "n2"),
        "n4": ("n3",), "n5": ("n3",), "n6": ("n4", "n5"),
    }


def test_unknown_shape_is_rejected() -> None:
    with pytest.raises(WorkloadError) as info:
        make_shape("star", 5, random.Random(1))
    assert "'star'" in str(info.value)
    for shape in SHAPES:
        assert shape in str(info.value)


@given(st.sampled_from(SHAPES), st.integers(1, 40), st.floats(0.2, 10.0))
def test_due_fraction_and_max_due(shape: str, size: int, max_due: float) -> None:
    none_due = make_shape(shape, size, random.Random(3), due_fraction=0.0, max_due=max_due)
    assert all(t.due_in is None for t in none_due)
    all_due = make_shape(shape, size, random.Random(3), due_fraction=1.0, max_due=max_due)
    for task in all_due:
        assert task.due_in is not None
        assert 0.1 <= task.due_in <= round(max_due, 3) + 0.001
        assert round(task.due_in, 3) == task.due_in
    assert all(t.awaits_signal is None for t in all_due)


def test_make_shape_is_deterministic_for_a_seed() -> None:
    assert make_shape("diamond", 30, random.Random(42)) == make_shape("diamond", 30, random.Random(42))


# --------------------------------------------------------------------------------------------------
# demo_workload


def test_demo_workload_cycles_over_three_types() -> None:
    specs = demo_workload(10, 6)
    assert len(specs) == 10
    assert [s.workflow_type for s in specs] == ["orders", "reports", "etl"] * 3 + ["orders"]
    assert [s.instance_id for s in specs] == [f"demo-{n:06d}" for n in range(10)]
    shapes = {"orders": "t0", "reports": "start", "etl": "n0"}
    for spec in specs:
        assert spec.tasks[0].key == shapes[spec.workflow_type]
        assert len(spec.tasks) == _expected_len({"orders": "chain", "reports": "fanout", "etl": "diamond"}
                                                [spec.workflow_type], 6)
        validate_dag(spec.instance_id, _deps_of(spec.tasks))


def test_demo_workload_prefix_seed_and_empty() -> None:
    assert demo_workload(0, 5) == []
    specs = demo_workload(3, 4, prefix="load")
    assert [s.instance_id for s in specs] == ["load-000000", "load-000001", "load-000002"]
    assert demo_workload(9, 8, seed=11) == demo_workload(9, 8, seed=11)
    assert demo_workload(9, 8, seed=11) != demo_workload(9, 8, seed=12)
    # Keys repeat across instances (they are per instance), ids never do.
    many = demo_workload(300, 3)
    assert len({s.instance_id for s in many}) == 300
