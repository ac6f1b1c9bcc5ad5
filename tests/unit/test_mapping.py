"""Unit tests of bridge.core.identifiers and bridge.core.mapping (no database server)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.core.errors import ConfigError, MappingError
from bridge.core.identifiers import validate_identifier, validate_optional_identifier
from bridge.core.mapping import (
    STATUS_NAMES,
    EdgesTable,
    InstancesTable,
    StatusValues,
    TaskColumns,
    TaskTableMapping,
)
from bridge.reference.schema import demo_metadata, is_default_mapping

VALID = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

TASK_COLUMN_NAMES = (
    "id", "instance_id", "task_key", "status", "depends_on", "due_at", "awaits_signal",
    "signal_received_at", "dispatched_at", "completed_at", "updated_at", "attempts", "max_attempts",
    "workflow_type",
)
REQUIRED_COLUMNS = ("id", "instance_id", "task_key", "status")

# Every configurable name, as a path inside the [mapping] table, and whether "" means "not mapped".
NAME_PATHS: list[tuple[tuple[str, ...], bool]] = [
    (("table",), False),
    (("schema",), True),
    *[(("columns", c), c not in REQUIRED_COLUMNS) for c in TASK_COLUMN_NAMES],
    (("instances", "table"), False),
    (("instances", "id"), False),
    (("instances", "workflow_type"), False),
    (("instances", "schema"), True),
    (("dependencies", "table"), False),
    (("dependencies", "task_id"), False),
    (("dependencies", "depends_on_id"), False),
    (("dependencies", "schema"), True),
]


def _raw_with(path: tuple[str, ...], value: object) -> dict[str, Any]:
    """A [mapping] table that sets ``path`` to ``value`` (edges mode for dependencies.* names)."""
    if len(path) == 1:
        return {path[0]: value}
    section, key = path
    inner: dict[str, Any] = {key: value}
    if section == "dependencies":
        inner["mode"] = "edges"
        inner.setdefault("table", "task_dependencies")
    return {section: inner}


def _read_back(mapping: TaskTableMapping, path: tuple[str, ...]) -> object:
    if len(path) == 1:
        return getattr(mapping, path[0])
    section, key = path
    target = {"columns": mapping.columns, "instances": mapping.instances, "dependencies": mapping.edges}[section]
    return getattr(target, key)


def _path_name(path: tuple[str, ...]) -> str:
    return "mapping." + ".".join(path)


_BAD_CHARS = st.sampled_from([*"\"'`; -.$/\\()\n\t\x00é*,=[]{}", "\u00a0", "\u0131", "ß", "٣"])
_valid_ids = st.from_regex(VALID, fullmatch=True)


@st.composite
def _crafted_invalid(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["bad_char", "leading_digit", "too_long", "quoted", "injection"]))
    base = draw(_valid_ids)
    if kind == "bad_char":
        pos = draw(st.integers(0, len(base)))
        return base[:pos] + draw(_BAD_CHARS) + base[pos:]
    if kind == "leading_digit":
        return draw(st.sampled_from("0123456789")) + base[:62]
    if kind == "too_long":
        return base + "a" * (64 - len(base)) + draw(st.text(alphabet="abc_019", max_size=20))
    if kind == "quoted":
        return f'"{base}"'
    return f"{base}; DROP TABLE tasks; --"


invalid_identifiers = st.one_of(st.text(), _crafted_invalid()).filter(lambda s: not VALID.fullmatch(s))
invalid_nonempty_identifiers = invalid_identifiers.filter(lambda s: s != "")


# --------------------------------------------------------------------------------------------------
# errors


def test_mapping_error_is_a_usage_config_error() -> None:
    assert issubclass(MappingError, ConfigError)
    assert MappingError.exit_code == 2
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict({"table": "bad name"})
    assert isinstance(info.value, ConfigError)
    assert info.value.exit_code == 2


# --------------------------------------------------------------------------------------------------
# identifiers


@given(_valid_ids)
def test_validate_identifier_accepts_valid(name: str) -> None:
    assert validate_identifier(name, "x") == name
    assert validate_optional_identifier(name, "x") == name


@given(invalid_identifiers)
def test_validate_identifier_rejects_invalid(name: str) -> None:
    with pytest.raises(MappingError, match=re.escape("invalid identifier for some.where")):
        validate_identifier(name, "some.where")


@pytest.mark.parametrize(
    "name",
    ["", "1abc", "9", "a b", "a;b", 'a"b', "a'b", "tasks; DROP TABLE x", " tasks", "tasks ", "a-b",
     "a.b", "tâches", "a" * 64, "_" + "b" * 63, "tasks\n", "\ttasks"],
)
def test_validate_identifier_rejects_examples(name: str) -> None:
    with pytest.raises(MappingError) as info:
        validate_identifier(name, "mapping.table")
    assert "mapping.table" in str(info.value)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("name", ["a", "_", "A1", "_9", "tasks", "T_a_s_k_s", "a" * 63, "_" + "b" * 62])
def test_validate_identifier_accepts_examples(name: str) -> None:
    assert validate_identifier(name, "x") == name


@pytest.mark.parametrize("value", [None, 1, 1.5, True, b"tasks", ["tasks"], {"a": 1}])
def test_validate_identifier_rejects_non_strings(value: object) -> None:
    with pytest.raises(MappingError, match="invalid identifier for what"):
        validate_identifier(value, "what")


def test_validate_optional_identifier_empty_means_unmapped() -> None:
    assert validate_optional_identifier(None, "x") is None
    assert validate_optional_identifier("", "x") is None
    with pytest.raises(MappingError):
        validate_optional_identifier(" ", "x")
    with pytest.raises(MappingError):
        validate_optional_identifier(0, "x")


# --------------------------------------------------------------------------------------------------
# defaults


def test_defaults_describe_the_reference_schema() -> None:
    mapping = TaskTableMapping()
    assert TaskTableMapping.from_dict({}) == mapping
    assert is_default_mapping(TaskTableMapping.from_dict({}))
    assert mapping.table == "tasks"
    assert mapping.schema is None
    assert mapping.dependency_mode == "json"
    assert mapping.edges is None
    assert mapping.instances == InstancesTable("workflow_instances", "id", "workflow_type", None)
    assert mapping.type_from_instances

    metadata = demo_metadata("sqlite")
    tasks = metadata.tables[mapping.table]
    # Every mapped column exists on the reference task table, and every reference column is mapped but the
    # optional trigger_rule (a mapping opts in with columns.trigger_rule: reference tables made before it
    # existed lack it, and the default mapping must still read them).
    mapped = mapping.columns.mapped()
    assert set(mapped.values()) == set(tasks.c.keys()) - {"trigger_rule"}
    assert mapped == {name: name for name in TASK_COLUMN_NAMES if name != "workflow_type"}
    assert mapping.columns.workflow_type is None

    assert mapping.instances is not None
    instances = metadata.tables[mapping.instances.table]
    assert mapping.instances.id in instances.c
    assert mapping.instances.workflow_type in instances.c


def test_default_status_values_match_the_reference_check_constraint() -> None:
    statuses = StatusValues()
    assert [getattr(statuses, n) for n in STATUS_NAMES] == ["pending", "queued", "running", "completed", "failed"]
    tasks = demo_metadata("sqlite").tables["tasks"]
    (check,) = [c for c in tasks.constraints if isinstance(c, sa.CheckConstraint)]
    allowed = set(re.findall(r"'([^']*)'", str(check.sqltext)))
    # the five required statuses plus the optional review; 'skipped' is allowed for a mapping that opts in
    assert allowed == set(statuses.values()) | {"skipped"}


def test_status_logical_lookup() -> None:
    statuses = StatusValues(dispatched="QUEUED", completed="done")
    assert statuses.logical("QUEUED") == "dispatched"
    assert statuses.logical("done") == "completed"
    assert statuses.logical("pending") == "pending"
    assert statuses.logical("queued") is None
    assert statuses.logical("completed") is None


# --------------------------------------------------------------------------------------------------
# unknown keys


@pytest.mark.parametrize(
    ("raw", "where", "key"),
    [
        ({"tabel": "tasks"}, "[mapping]", "tabel"),
        ({"columns": {"statuss": "status"}}, "[mapping.columns]", "statuss"),
        ({"columns": {"REQUIRED": ["id"]}}, "[mapping.columns]", "REQUIRED"),
        ({"statuses": {"done": "ok"}}, "[mapping.statuses]", "done"),
        ({"dependencies": {"mode": "edges", "tabel": "deps"}}, "[mapping.dependencies]", "tabel"),
        ({"instances": {"type_column": "wt"}}, "[mapping.instances]", "type_column"),
    ],
)
def test_unknown_keys_are_rejected_naming_the_key(raw: dict[str, Any], where: str, key: str) -> None:
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict(raw)
    message = str(info.value)
    assert key in message
    assert where in message
    assert "unknown key" in message


@given(st.text(min_size=1).filter(lambda k: k not in {"table", "schema", "columns", "statuses",
                                                         "dependencies", "instances"}))
def test_any_unknown_top_level_key_is_rejected(key: str) -> None:
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict({key: "x"})
    assert repr(key) in str(info.value)  # shown with repr(): a control character cannot break the line


@pytest.mark.parametrize("instances", [{"bogus": "x"}, {"table": "bad name"}])
def test_instances_section_still_validated_when_type_is_a_column(instances: dict[str, Any]) -> None:
    with pytest.raises(MappingError):
        TaskTableMapping.from_dict({"columns": {"workflow_type": "wf_type"}, "instances": instances})


@pytest.mark.parametrize("section", ["columns", "statuses", "instances"])
@pytest.mark.parametrize("value", ["x", 5, ["a"], True])
def test_non_table_sections_are_rejected(section: str, value: object) -> None:
    with pytest.raises(MappingError, match=f"mapping.{section} must be a table"):
        TaskTableMapping.from_dict({section: value})


@pytest.mark.parametrize("value", ["edges", 5, ["mode"]])
def test_non_table_dependencies_is_a_mapping_error(value: object) -> None:
    with pytest.raises(MappingError):
        TaskTableMapping.from_dict({"dependencies": value})


# --------------------------------------------------------------------------------------------------
# identifiers in every configurable name


@pytest.mark.parametrize(("path", "optional"), NAME_PATHS, ids=[_path_name(p) for p, _ in NAME_PATHS])
@settings(max_examples=10)
@given(data=st.data())
def test_invalid_identifier_rejected_for_every_name(path: tuple[str, ...], optional: bool, data: st.DataObject) -> None:
    name = data.draw(invalid_nonempty_identifiers if optional else invalid_identifiers, label="name")
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict(_raw_with(path, name))
    message = str(info.value)
    assert _path_name(path) in message
    assert "invalid identifier" in message


@pytest.mark.parametrize(("path", "optional"), NAME_PATHS, ids=[_path_name(p) for p, _ in NAME_PATHS])
@settings(max_examples=5)
@given(data=st.data())
def test_valid_identifier_accepted_for_every_name(path: tuple[str, ...], optional: bool, data: st.DataObject) -> None:
    name = data.draw(_valid_ids, label="name")
    mapping = TaskTableMapping.from_dict(_raw_with(path, name))
    assert _read_back(mapping, path) == name


@pytest.mark.parametrize(("path", "optional"), NAME_PATHS, ids=[_path_name(p) for p, _ in NAME_PATHS])
@pytest.mark.parametrize("value", [5, True, ["tasks"]])
def test_non_string_name_rejected_for_every_name(path: tuple[str, ...], optional: bool, value: object) -> None:
    if value == ["tasks"] and path in {("columns", "instance_id"), ("columns", "task_key")}:
        # A list of columns is a composite key there (tested below); a list of non-names is still refused.
        value = [5]
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict(_raw_with(path, value))
    assert _path_name(path) in str(info.value)


@pytest.mark.parametrize(("path", "optional"), NAME_PATHS, ids=[_path_name(p) for p, _ in NAME_PATHS])
def test_empty_name_rejected_unless_optional(path: tuple[str, ...], optional: bool) -> None:
    raw = _raw_with(path, "")
    if path in {("columns", "awaits_signal"), ("columns", "signal_received_at")}:
        # Optional, but only as a pair: unmapping one alone is its own error (tested below).
        raw["columns"] = {"awaits_signal": "", "signal_received_at": ""}
    if path == ("columns", "depends_on"):
        # Optional, but json mode (the default) needs it.
        with pytest.raises(MappingError, match=re.escape("needs mapping.columns.depends_on")):
            TaskTableMapping.from_dict(raw)
        raw = {"columns": {"depends_on": ""}, "dependencies": {"mode": "edges", "table": "deps"}}
    if optional:
        assert _read_back(TaskTableMapping.from_dict(raw), path) is None
    else:
        with pytest.raises(MappingError) as info:
            TaskTableMapping.from_dict(raw)
        assert _path_name(path) in str(info.value)


@pytest.mark.parametrize("column", REQUIRED_COLUMNS)
def test_task_columns_dataclass_validates_required(column: str) -> None:
    with pytest.raises(MappingError, match=f"mapping.columns.{column}"):
        TaskColumns(**{column: None})
    with pytest.raises(MappingError, match=f"mapping.columns.{column}"):
        TaskColumns(**{column: "x y"})


def test_dataclasses_validate_on_direct_construction() -> None:
    with pytest.raises(MappingError, match=r"mapping\.instances\.workflow_type"):
        InstancesTable(workflow_type="wf type")
    with pytest.raises(MappingError, match=r"mapping\.dependencies\.depends_on_id"):
        EdgesTable(depends_on_id="1dep")
    with pytest.raises(MappingError, match=r"mapping\.schema"):
        TaskTableMapping(schema="public;")
    assert TaskColumns(due_at="").due_at is None
    assert EdgesTable(schema="").schema is None


# --------------------------------------------------------------------------------------------------
# statuses


@given(data=st.data())
def test_status_value_mapped_twice_names_both_statuses(data: st.DataObject) -> None:
    first, second = data.draw(
        st.lists(st.sampled_from(STATUS_NAMES), min_size=2, max_size=2, unique=True).map(
            lambda pair: sorted(pair, key=STATUS_NAMES.index)
        )
    )
    value = data.draw(st.text(min_size=1))
    statuses = {name: f"value_{i}" for i, name in enumerate(STATUS_NAMES)}
    statuses[first] = statuses[second] = value
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict({"statuses": statuses})
    message = str(info.value)
    assert repr(first) in message
    assert repr(second) in message
    assert repr(value) in message
    assert "mapped twice" in message


def test_status_value_collision_with_a_default_is_rejected() -> None:
    # Mapping "running" to "queued" collides with the default value of "dispatched".
    with pytest.raises(MappingError) as info:
        StatusValues(running="queued")
    assert "'dispatched'" in str(info.value)
    assert "'running'" in str(info.value)


@pytest.mark.parametrize("value", ["", None, 3, [3], [""], []])
@pytest.mark.parametrize("status", STATUS_NAMES)
def test_status_value_must_be_non_empty_string(status: str, value: object) -> None:
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict({"statuses": {status: value}})
    assert repr(status) in str(info.value)


def test_custom_statuses_are_kept() -> None:
    custom = {"pending": "P", "dispatched": "Q", "running": "R", "completed": "C", "failed": "F"}
    mapping = TaskTableMapping.from_dict({"statuses": custom})
    assert mapping.statuses == StatusValues(**custom)


# --------------------------------------------------------------------------------------------------
# columns, dependencies, workflow type


@pytest.mark.parametrize("missing", ["awaits_signal", "signal_received_at"])
def test_awaits_signal_and_signal_received_at_go_together(missing: str) -> None:
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict({"columns": {missing: ""}})
    assert "awaits_signal" in str(info.value)
    assert "signal_received_at" in str(info.value)
    with pytest.raises(MappingError):
        TaskColumns(**{missing: None})


def test_awaits_signal_and_signal_received_at_both_unmapped_is_fine() -> None:
    mapping = TaskTableMapping.from_dict({"columns": {"awaits_signal": "", "signal_received_at": ""}})
    assert mapping.columns.awaits_signal is None
    assert mapping.columns.signal_received_at is None
    assert "awaits_signal" not in mapping.columns.mapped()


def test_edges_mode_without_edges_table_is_rejected() -> None:
    with pytest.raises(MappingError, match=re.escape("mode = 'edges' needs mapping.dependencies.table")):
        TaskTableMapping(dependency_mode="edges", edges=None)


def test_edges_mode_without_table_key_is_rejected_by_from_dict() -> None:
    with pytest.raises(MappingError, match=re.escape("mapping.dependencies.table")):
        TaskTableMapping.from_dict({"dependencies": {"mode": "edges"}})


def test_edges_mode_with_table() -> None:
    mapping = TaskTableMapping.from_dict(
        {"dependencies": {"mode": "edges", "table": "deps", "task_id": "t", "depends_on_id": "d", "schema": "s"}}
    )
    assert mapping.dependency_mode == "edges"
    assert mapping.edges == EdgesTable(table="deps", task_id="t", depends_on_id="d", schema="s")


def test_edges_mode_does_not_need_depends_on_column() -> None:
    mapping = TaskTableMapping.from_dict(
        {"columns": {"depends_on": ""}, "dependencies": {"mode": "edges", "table": "deps"}}
    )
    assert mapping.columns.depends_on is None


def test_json_mode_needs_depends_on_column() -> None:
    with pytest.raises(MappingError, match=re.escape("needs mapping.columns.depends_on")):
        TaskTableMapping.from_dict({"columns": {"depends_on": ""}})


@given(st.text().filter(lambda m: m not in ("json", "edges")))
def test_mode_other_than_json_or_edges_is_rejected(mode: str) -> None:
    with pytest.raises(MappingError) as info:
        TaskTableMapping.from_dict({"dependencies": {"mode": mode}})
    assert "mapping.dependencies.mode" in str(info.value)
    assert repr(mode) in str(info.value)


def test_mode_other_than_json_or_edges_is_rejected_by_constructor() -> None:
    with pytest.raises(MappingError, match=re.escape("mapping.dependencies.mode")):
        TaskTableMapping(dependency_mode="graph")  # type: ignore[arg-type]


def test_edge_keys_without_edges_mode_are_rejected() -> None:
    with pytest.raises(MappingError, match="only used with mode = 'edges'"):
        TaskTableMapping.from_dict({"dependencies": {"table": "deps"}})
    with pytest.raises(MappingError, match="only used with mode = 'edges'"):
        TaskTableMapping.from_dict({"dependencies": {"mode": "json", "task_id": "t"}})


def test_workflow_type_column_disables_instances_join() -> None:
    mapping = TaskTableMapping.from_dict({"columns": {"workflow_type": "wf_type"}})
    assert mapping.columns.workflow_type == "wf_type"
    assert mapping.instances is None
    assert not mapping.type_from_instances
    assert mapping.columns.mapped()["workflow_type"] == "wf_type"


def test_instances_join_is_used_without_workflow_type_column() -> None:
    mapping = TaskTableMapping.from_dict({"instances": {"table": "runs", "id": "run_id", "schema": "wf"}})
    assert mapping.type_from_instances
    assert mapping.instances == InstancesTable(table="runs", id="run_id", workflow_type="workflow_type", schema="wf")


def test_no_workflow_type_source_is_rejected() -> None:
    with pytest.raises(MappingError, match="workflow type has no source"):
        TaskTableMapping.from_dict({"instances": False})
    with pytest.raises(MappingError, match="workflow type has no source"):
        TaskTableMapping(instances=None)
    mapping = TaskTableMapping.from_dict({"instances": False, "columns": {"workflow_type": "kind"}})
    assert mapping.instances is None


def test_mapping_is_frozen() -> None:
    mapping = TaskTableMapping()
    with pytest.raises(AttributeError):
        mapping.table = "other"  # type: ignore[misc]
