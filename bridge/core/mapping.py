"""The mapping of the existing scheduler's task table.

pollbridge does not own the task table: it belongs to the scheduler being migrated. Everything
pollbridge reads or writes there goes through a :class:`TaskTableMapping`, which names the table,
its columns, the status values and how dependencies are stored. The default mapping is the
reference legacy schema that ``pollbridge init --demo-schema`` creates.

Dependencies are stored either as a JSON array of task keys on the task row (``mode = "json"``,
keys resolved within the same instance) or in an edges table of (task id, depends-on task id)
pairs (``mode = "edges"``). The workflow type is a column of the task table or is joined from an
instances table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from bridge.core.errors import MappingError
from bridge.core.identifiers import validate_identifier, validate_optional_identifier

DependencyMode = Literal["json", "edges"]

#: Logical statuses pollbridge understands, in lifecycle order.
STATUS_NAMES = ("pending", "dispatched", "running", "completed", "failed")
#: Optional logical statuses: ``review`` is where the depth guard parks a runaway workflow's task for
#: a person to look at ("" = the table has no such status; the guard then only holds the task back).
OPTIONAL_STATUS_NAMES = ("review",)


@dataclass(frozen=True)
class StatusValues:
    """The value the task table stores for each logical status. No value may be used twice."""

    pending: str = "pending"
    dispatched: str = "queued"
    running: str = "running"
    completed: str = "completed"
    failed: str = "failed"
    review: str | None = "review"

    def __post_init__(self) -> None:
        if self.review == "":
            object.__setattr__(self, "review", None)
        seen: dict[str, str] = {}
        for name in self.names():
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise MappingError(f"status value for {name!r} must be a non-empty string, got {value!r}")
            if value in seen:
                raise MappingError(
                    f"status value {value!r} is mapped twice (to {seen[value]!r} and {name!r}); "
                    "each logical status needs its own value"
                )
            seen[value] = name

    def names(self) -> tuple[str, ...]:
        """The logical statuses this mapping has (the five required ones, plus mapped optional ones)."""
        return STATUS_NAMES + tuple(n for n in OPTIONAL_STATUS_NAMES if getattr(self, n) is not None)

    def values(self) -> frozenset[str]:
        return frozenset(getattr(self, n) for n in self.names())

    def logical(self, value: str) -> str | None:
        """The logical status name of a stored value, or ``None`` for a value that is not mapped."""
        for name in self.names():
            if getattr(self, name) == value:
                return name
        return None


@dataclass(frozen=True)
class TaskColumns:
    """Column names on the task table. Optional columns are ``None`` when the table lacks them."""

    id: str = "id"
    instance_id: str = "instance_id"
    task_key: str = "task_key"
    status: str = "status"
    depends_on: str | None = "depends_on"
    due_at: str | None = "due_at"
    awaits_signal: str | None = "awaits_signal"
    signal_received_at: str | None = "signal_received_at"
    dispatched_at: str | None = "dispatched_at"
    completed_at: str | None = "completed_at"
    updated_at: str | None = "updated_at"
    attempts: str | None = "attempts"
    max_attempts: str | None = "max_attempts"
    workflow_type: str | None = None

    REQUIRED = ("id", "instance_id", "task_key", "status")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.REQUIRED:
                validate_identifier(value, f"mapping.columns.{f.name}")
            else:
                object.__setattr__(
                    self, f.name, validate_optional_identifier(value, f"mapping.columns.{f.name}")
                )
        if (self.awaits_signal is None) != (self.signal_received_at is None):
            raise MappingError(
                "mapping.columns.awaits_signal and mapping.columns.signal_received_at must be "
                "mapped together (or both left empty)"
            )

    def mapped(self) -> dict[str, str]:
        """Logical name → column name, for every mapped column."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class InstancesTable:
    """Where the workflow type comes from when the task table has no such column."""

    table: str = "workflow_instances"
    id: str = "id"
    workflow_type: str = "workflow_type"
    schema: str | None = None

    def __post_init__(self) -> None:
        validate_identifier(self.table, "mapping.instances.table")
        validate_identifier(self.id, "mapping.instances.id")
        validate_identifier(self.workflow_type, "mapping.instances.workflow_type")
        object.__setattr__(self, "schema", validate_optional_identifier(self.schema, "mapping.instances.schema"))


@dataclass(frozen=True)
class EdgesTable:
    """The dependency edges table for ``dependencies.mode = "edges"``."""

    table: str = "task_dependencies"
    task_id: str = "task_id"
    depends_on_id: str = "depends_on_id"
    schema: str | None = None

    def __post_init__(self) -> None:
        validate_identifier(self.table, "mapping.dependencies.table")
        validate_identifier(self.task_id, "mapping.dependencies.task_id")
        validate_identifier(self.depends_on_id, "mapping.dependencies.depends_on_id")
        object.__setattr__(
            self, "schema", validate_optional_identifier(self.schema, "mapping.dependencies.schema")
        )


@dataclass(frozen=True)
class TaskTableMapping:
    """The whole mapping: task table, columns, statuses, dependency storage, workflow-type source."""

    table: str = "tasks"
    schema: str | None = None
    columns: TaskColumns = field(default_factory=TaskColumns)
    statuses: StatusValues = field(default_factory=StatusValues)
    dependency_mode: DependencyMode = "json"
    edges: EdgesTable | None = None
    instances: InstancesTable | None = field(default_factory=InstancesTable)

    def __post_init__(self) -> None:
        validate_identifier(self.table, "mapping.table")
        object.__setattr__(self, "schema", validate_optional_identifier(self.schema, "mapping.schema"))
        if self.dependency_mode not in ("json", "edges"):
            raise MappingError(
                f"mapping.dependencies.mode must be 'json' or 'edges', got {self.dependency_mode!r}"
            )
        if self.dependency_mode == "json" and self.columns.depends_on is None:
            raise MappingError("mapping.dependencies.mode = 'json' needs mapping.columns.depends_on")
        if self.dependency_mode == "edges" and self.edges is None:
            raise MappingError("mapping.dependencies.mode = 'edges' needs mapping.dependencies.table")
        if self.columns.workflow_type is None and self.instances is None:
            raise MappingError(
                "the workflow type has no source: set mapping.columns.workflow_type or mapping.instances"
            )

    @property
    def type_from_instances(self) -> bool:
        return self.columns.workflow_type is None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TaskTableMapping:
        """Build a mapping from the ``[mapping]`` table of ``pollbridge.toml``. Unknown keys are errors."""
        raw = dict(raw)
        _reject_unknown(raw, {"table", "schema", "columns", "statuses", "dependencies", "instances"}, "mapping")
        columns = TaskColumns(**_section(raw, "columns", TaskColumns))
        statuses = StatusValues(**_section(raw, "statuses", StatusValues))
        deps = _section(raw, "dependencies", EdgesTable, extra={"mode"})
        mode = deps.pop("mode", "json")
        if mode == "edges" and "table" not in deps:
            raise MappingError("mapping.dependencies.mode = 'edges' needs mapping.dependencies.table")
        edges = EdgesTable(**deps) if mode == "edges" else None
        if mode != "edges" and deps:
            raise MappingError("mapping.dependencies table/columns are only used with mode = 'edges'")
        instances: InstancesTable | None = None
        if raw.get("instances") is not False:  # `instances = false`: the type is a task-table column
            # Validated even when unused, so a typo is reported rather than silently ignored.
            configured = InstancesTable(**_section(raw, "instances", InstancesTable))
            instances = None if columns.workflow_type is not None else configured
        return cls(
            table=raw.get("table", "tasks"),
            schema=raw.get("schema"),
            columns=columns,
            statuses=statuses,
            dependency_mode=mode,
            edges=edges,
            instances=instances,
        )


def _section(raw: Mapping[str, Any], key: str, kind: type, extra: set[str] | None = None) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MappingError(f"mapping.{key} must be a table, got {type(value).__name__}")
    allowed = {f.name for f in fields(kind)} | (extra or set())
    _reject_unknown(value, allowed, f"mapping.{key}")
    return dict(value)


def _reject_unknown(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise MappingError(f"unknown key(s) in [{where}]: {', '.join(map(repr, unknown))}; expected some of: "
                           f"{', '.join(sorted(allowed))}")
