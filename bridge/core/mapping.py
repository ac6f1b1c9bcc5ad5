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

DependencyMode = Literal["json", "edges", "keys"]
AttemptMoves = Literal["claim", "dispatch"]
#: What ``[mapping.dispatch] set`` may write into an extra column when pollbridge dispatches: the
#: database clock, or the column's value plus one. A fixed grammar: no SQL text comes from configuration.
DISPATCH_SET_VALUES = ("now", "increment")
#: Trigger rules (Airflow's names): when a task whose dependencies are in the given states may run.
TRIGGER_RULES = ("all_success", "all_done", "all_failed", "all_skipped", "one_success", "one_failed", "one_done",
                 "none_failed", "none_failed_min_one_success", "none_skipped", "always")

#: Logical statuses pollbridge understands, in lifecycle order.
STATUS_NAMES = ("pending", "dispatched", "running", "completed", "failed")
#: Optional logical statuses: ``review`` is where the depth guard parks a runaway workflow's task for
#: a person to look at ("" = the table has no such status; the guard then only holds the task back);
#: ``skipped`` is a done status that is neither success nor failure (a branch not taken).
OPTIONAL_STATUS_NAMES = ("review", "skipped")


#: Statuses a task in the given logical status may be in; ``done`` statuses end a task's attempt.
DONE_STATUSES = ("completed", "failed", "skipped")


def _status_list(value: object, name: str) -> tuple[str, ...]:
    """The stored values of one logical status: a string or a list of strings (``""``/``[]`` = none)."""
    if value is None or value == "":
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise MappingError(f"status value for {name!r} must be a string or a list of strings, got {value!r}")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise MappingError(f"status value for {name!r} must be a non-empty string, got {item!r}")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class StatusValues:
    """The values the task table stores for each logical status. No value may be used twice.

    Each logical status takes one stored value or a list of them (``pending = ["up_for_retry",
    "up_for_reschedule"]``); the first is the one pollbridge writes when it moves a task into that status.
    ``null`` names the logical status a NULL status means (Airflow: a waiting task instance has state
    NULL, so ``null = "pending"``). ``skipped`` (optional) is a done status that is neither success nor
    failure (a branch not taken); ``other`` lists stored values pollbridge passes through without
    meaning (captured as events, never dead-lettered). After construction each attribute holds the
    *written* value (a string, or ``None`` when the status has no stored value); :meth:`of` gives all."""

    pending: Any = "pending"
    dispatched: Any = "queued"
    running: Any = "running"
    completed: Any = "completed"
    failed: Any = "failed"
    review: Any = "review"
    skipped: Any = None
    other: Any = ()
    null: str | None = None
    sets: tuple[tuple[str, tuple[str, ...]], ...] = field(init=False, repr=False, compare=True, default=())

    def __post_init__(self) -> None:
        if self.null == "":
            object.__setattr__(self, "null", None)
        if self.null is not None and self.null not in STATUS_NAMES + OPTIONAL_STATUS_NAMES:
            raise MappingError(f"mapping.statuses.null must name a logical status ({', '.join(STATUS_NAMES)}, "
                               f"skipped), got {self.null!r}")
        sets: dict[str, tuple[str, ...]] = {}
        for name in STATUS_NAMES + OPTIONAL_STATUS_NAMES + ("other",):
            sets[name] = _status_list(getattr(self, name), name)
        for name in STATUS_NAMES:
            if not sets[name] and self.null != name:
                raise MappingError(f"status value for {name!r} must be a non-empty string, got {getattr(self, name)!r}")
        seen: dict[str, str] = {}
        for name, values in sets.items():
            for value in values:
                if value in seen:
                    raise MappingError(
                        f"status value {value!r} is mapped twice (to {seen[value]!r} and {name!r}); "
                        "each logical status needs its own value"
                    )
                seen[value] = name
        for name in STATUS_NAMES + OPTIONAL_STATUS_NAMES:
            object.__setattr__(self, name, sets[name][0] if sets[name] else None)
        object.__setattr__(self, "other", sets["other"])
        object.__setattr__(self, "sets", tuple(sets.items()))

    def names(self) -> tuple[str, ...]:
        """The logical statuses this mapping has (the five required ones, plus mapped optional ones)."""
        return STATUS_NAMES + tuple(n for n in OPTIONAL_STATUS_NAMES
                                    if dict(self.sets)[n] or self.null == n)

    def of(self, name: str) -> tuple[str | None, ...]:
        """Every stored value of logical status ``name`` (``None`` standing for SQL NULL)."""
        values: tuple[str | None, ...] = dict(self.sets).get(name, ())
        return values + ((None,) if self.null == name else ())

    def write(self, name: str) -> str:
        """The value pollbridge writes to move a task into ``name`` (an error if the table has none)."""
        value = getattr(self, name, None)
        if not isinstance(value, str):
            raise MappingError(f"the task table has no stored value for status {name!r} that pollbridge could write")
        return value

    def values(self) -> frozenset[str]:
        """Every stored (non-NULL) value the mapping knows, ``other`` included."""
        return frozenset(v for _, values in self.sets for v in values)

    def logical(self, value: str | None) -> str | None:
        """The logical status name of a stored value (``other`` for a pass-through value), or ``None``
        for a value that is not mapped."""
        if value is None:
            return self.null
        for name, values in self.sets:
            if value in values:
                return name
        return None

    def known(self, value: str | None) -> bool:
        """Whether a stored value (``None`` = NULL) is mapped to a logical status or declared ``other``."""
        return self.logical(value) is not None


@dataclass(frozen=True)
class TaskColumns:
    """Column names on the task table. Optional columns are ``None`` when the table lacks them."""

    id: str = "id"
    instance_id: Any = "instance_id"
    task_key: Any = "task_key"
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
    trigger_rule: str | None = None
    #: When the row's latest change committed (a view's ``pg_xact_commit_timestamp(xmin)``, say): the task's
    #: ready time is floored at it, for engines that stamp ``completed_at`` before they commit.
    committed_at: str | None = None
    #: The task's causation depth as the platform stamps it: 0 for a task of the workflow's definition, d + 1
    #: for a task spawned by a task of depth d (the depth guard parks a task past ``max_depth``).
    depth: str | None = None
    #: Or the row id of the task whose run spawned this one (NULL for the definition's tasks): pollbridge then
    #: derives the depth by following the chain, at most ``max_depth`` + 1 links.
    spawned_by: str | None = None

    REQUIRED = ("id", "instance_id", "task_key", "status")
    #: Logical keys that may be made of several columns (``instance_id = ["dag_id", "run_id"]``).
    COMPOSITE = ("instance_id", "task_key")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.COMPOSITE and isinstance(value, list | tuple):
                if not value:
                    raise MappingError(f"mapping.columns.{f.name} must name at least one column")
                parts = tuple(validate_identifier(v, f"mapping.columns.{f.name}") for v in value)
                if len(set(parts)) != len(parts):
                    raise MappingError(f"mapping.columns.{f.name} names a column twice: {list(parts)}")
                object.__setattr__(self, f.name, parts[0] if len(parts) == 1 else parts)
            elif f.name in self.REQUIRED:
                validate_identifier(value, f"mapping.columns.{f.name}")
            else:
                object.__setattr__(
                    self, f.name, validate_optional_identifier(value, f"mapping.columns.{f.name}")
                )
        if self.depth is not None and self.spawned_by is not None:
            raise MappingError("map either mapping.columns.depth (the depth the platform stamps) or "
                               "mapping.columns.spawned_by (the spawning task's id), not both")
        if (self.awaits_signal is None) != (self.signal_received_at is None):
            raise MappingError(
                "mapping.columns.awaits_signal and mapping.columns.signal_received_at must be "
                "mapped together (or both left empty)"
            )

    def parts(self, logical: str) -> tuple[str, ...]:
        """The column(s) of a logical name: one for a plain column, several for a composite key."""
        value = getattr(self, logical)
        if value is None:
            return ()
        return value if isinstance(value, tuple) else (value,)

    def composite(self, logical: str) -> bool:
        return isinstance(getattr(self, logical), tuple)

    def mapped(self) -> dict[str, str]:
        """Logical name → column name, for every mapped column (a composite key's parts as
        ``instance_id[0]``, ``instance_id[1]``, ...)."""
        out: dict[str, str] = {}
        for f in fields(self):
            parts = self.parts(f.name)
            if len(parts) == 1:
                out[f.name] = parts[0]
            else:
                out.update({f"{f.name}[{i}]": p for i, p in enumerate(parts)})
        return out


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
    """The dependency table for ``dependencies.mode = "edges"`` or ``"keys"``.

    ``edges``: rows of (task row id, depends-on task row id). ``keys``: rows of (task key, depends-on
    key) that hold for every instance whose task rows match the edge on the ``match`` columns (a
    workflow definition's edges, e.g. Airflow's per DAG version): the dependent task is the row whose
    ``key_column`` equals ``task_key`` and the dependencies are the rows of the same instance whose
    ``key_column`` equals ``depends_on_key`` (several rows when the key repeats, e.g. mapped tasks).
    ``rule`` (optional) is an edges column holding the dependent task's trigger rule."""

    table: str = "task_dependencies"
    task_id: str = "task_id"
    depends_on_id: str = "depends_on_id"
    schema: str | None = None
    task_key: str | None = None
    depends_on_key: str | None = None
    key_column: str | None = None
    match: tuple[str, ...] = ()
    rule: str | None = None

    def __post_init__(self) -> None:
        validate_identifier(self.table, "mapping.dependencies.table")
        validate_identifier(self.task_id, "mapping.dependencies.task_id")
        validate_identifier(self.depends_on_id, "mapping.dependencies.depends_on_id")
        object.__setattr__(
            self, "schema", validate_optional_identifier(self.schema, "mapping.dependencies.schema")
        )
        for name in ("task_key", "depends_on_key", "key_column", "rule"):
            object.__setattr__(self, name, validate_optional_identifier(getattr(self, name),
                                                                        f"mapping.dependencies.{name}"))
        match = self.match
        if isinstance(match, str):
            match = (match,)
        if not isinstance(match, list | tuple):
            raise MappingError(f"mapping.dependencies.match must be a list of column names, got {match!r}")
        object.__setattr__(self, "match", tuple(validate_identifier(m, "mapping.dependencies.match") for m in match))


#: The most ``[[mapping.related]]`` tables (each has a capture function and two triggers of its own).
MAX_RELATED = 8


@dataclass(frozen=True)
class RelatedTable:
    """Another table whose changes affect tasks' readiness (``[[mapping.related]]``): a job row whose state is
    the status of the step rows pointing at it, say. Capture sits on it too: a change of a ``watch`` column
    (or an insert) is captured as a status change of every task row (read through ``mapping.read_table``)
    whose ``match`` columns equal the changed row's, carrying the task's status as read then.

    ``match``: pairs of (task column, related column); ``watch``: related columns whose change matters.
    ``columns``: pairs of (task column, related column) for the task columns the read view takes from this
    row (its state as the task's status, its attempt counter): capture from the write-ahead log reads the
    matching tasks after the change committed, maybe after later changes too, and takes these values from
    the change itself, so a dispatch followed at once by the start is still captured as a dispatch.
    Needed there for the status column when the view takes it from this table."""

    table: str
    match: tuple[tuple[str, str], ...]
    watch: tuple[str, ...]
    schema: str | None = None
    columns: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        validate_identifier(self.table, "mapping.related.table")
        object.__setattr__(self, "schema", validate_optional_identifier(self.schema, "mapping.related.schema"))
        if not self.match:
            raise MappingError(f"mapping.related ({self.table}): match needs at least one task column = related "
                               "column pair")
        for task_column, related_column in self.match:
            validate_identifier(task_column, "mapping.related.match")
            validate_identifier(related_column, "mapping.related.match")
        if not self.watch:
            raise MappingError(f"mapping.related ({self.table}): watch needs at least one column whose change "
                               "matters (its state, say)")
        for column in self.watch:
            validate_identifier(column, "mapping.related.watch")
        for task_column, related_column in self.columns:
            validate_identifier(task_column, "mapping.related.columns")
            validate_identifier(related_column, "mapping.related.columns")

    @classmethod
    def from_dict(cls, raw: Any) -> RelatedTable:
        if not isinstance(raw, Mapping):
            raise MappingError(f"each [[mapping.related]] must be a table, got {type(raw).__name__}")
        _reject_unknown(raw, {"table", "schema", "match", "watch", "columns"}, "mapping.related")
        if "table" not in raw:
            raise MappingError("[[mapping.related]] needs table")
        match = raw.get("match") or {}
        if not isinstance(match, Mapping):
            raise MappingError("mapping.related.match must be a table of task column = related column")
        watch = raw.get("watch") or ()
        if isinstance(watch, str):
            watch = (watch,)
        if not isinstance(watch, list | tuple):
            raise MappingError("mapping.related.watch must be a list of column names")
        columns = raw.get("columns") or {}
        if not isinstance(columns, Mapping):
            raise MappingError("mapping.related.columns must be a table of task column = related column")
        return cls(table=raw["table"], schema=raw.get("schema"),
                   match=tuple((str(k), v) for k, v in match.items()), watch=tuple(watch),
                   columns=tuple((str(k), v) for k, v in columns.items()))


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
    #: Reads (evaluation, checks, explain) and pollbridge's own writes (a dispatch, a skip, a retry: only in
    #: selective and cutover, and only through a view updatable for them, see preflight's dispatch_writable)
    #: go through this relation (a view the user owns) when set; capture sits on ``table``.
    read_table: str | None = None
    #: When the attempts column moves: ``claim`` (a worker's claim increments it: the reference) or
    #: ``dispatch`` (the dispatch itself increments it: Airflow's try_number).
    attempt_moves: AttemptMoves = "claim"
    #: Extra columns pollbridge sets when it dispatches: column → "now" | "increment".
    dispatch_set: tuple[tuple[str, str], ...] = ()
    #: SQL the user owns, installed by ``init`` and removed by ``uninstall`` (a file of named blocks
    #: ``install``/``uninstall``; relative to the configuration file).
    install_sql: str | None = None
    #: Other tables whose changes affect readiness, captured too (``[[mapping.related]]``).
    related: tuple[RelatedTable, ...] = ()

    def __post_init__(self) -> None:
        validate_identifier(self.table, "mapping.table")
        object.__setattr__(self, "schema", validate_optional_identifier(self.schema, "mapping.schema"))
        object.__setattr__(self, "read_table", validate_optional_identifier(self.read_table, "mapping.read_table"))
        if self.attempt_moves not in ("claim", "dispatch"):
            raise MappingError("mapping.dispatch.attempt_moves must be 'claim' or 'dispatch', "
                               f"got {self.attempt_moves!r}")
        for column, value in self.dispatch_set:
            validate_identifier(column, "mapping.dispatch.set")
            if value not in DISPATCH_SET_VALUES:
                raise MappingError(f"mapping.dispatch.set.{column} must be one of {', '.join(DISPATCH_SET_VALUES)}, "
                                   f"got {value!r}")
        attempts = self.columns.attempts
        if self.attempt_moves == "dispatch" and attempts and (attempts, "increment") not in self.dispatch_set:
            # Else pollbridge's own dispatch would record attempt N+1 for a row that still says N, and its captured
            # change would pass for another scheduler's dispatch of attempt N.
            raise MappingError(f"mapping.dispatch.attempt_moves = 'dispatch' needs mapping.dispatch.set."
                               f"{attempts} = \"increment\" (pollbridge's dispatch must move it too)")
        if self.install_sql is not None and (not isinstance(self.install_sql, str) or not self.install_sql):
            raise MappingError("mapping.install_sql must be a file name")
        if self.dependency_mode not in ("json", "edges", "keys"):
            raise MappingError(
                f"mapping.dependencies.mode must be 'json', 'edges' or 'keys', got {self.dependency_mode!r}"
            )
        if self.dependency_mode == "keys":
            if self.edges is None or self.edges.task_key is None or self.edges.depends_on_key is None:
                raise MappingError("mapping.dependencies.mode = 'keys' needs mapping.dependencies.table, "
                                   "task_key and depends_on_key")
            if self.edges.key_column is None and self.columns.composite("task_key"):
                raise MappingError("mapping.dependencies.key_column is needed when mapping.columns.task_key "
                                   "has several columns")
        if self.dependency_mode == "json" and self.columns.depends_on is None:
            raise MappingError("mapping.dependencies.mode = 'json' needs mapping.columns.depends_on")
        if self.dependency_mode in ("edges", "keys") and self.edges is None:
            raise MappingError("mapping.dependencies.mode = 'edges' needs mapping.dependencies.table")
        names = [(r.schema, r.table) for r in self.related]
        if len(set(names)) != len(names) or (self.schema, self.table) in names:
            raise MappingError("mapping.related names a table twice (or mapping.table itself, which is captured "
                               "already)")
        if len(self.related) > MAX_RELATED:
            raise MappingError(f"mapping.related: at most {MAX_RELATED} related tables")
        if self.columns.workflow_type is None and self.instances is None:
            raise MappingError(
                "the workflow type has no source: set mapping.columns.workflow_type or mapping.instances"
            )

    @property
    def type_from_instances(self) -> bool:
        return self.columns.workflow_type is None

    @property
    def dependency_key_column(self) -> str:
        """The task-table column that ``keys``-mode edges name (the task key when it is one column)."""
        assert self.edges is not None
        return self.edges.key_column or self.columns.parts("task_key")[0]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TaskTableMapping:
        """Build a mapping from the ``[mapping]`` table of ``pollbridge.toml``. Unknown keys are errors."""
        raw = dict(raw)
        _reject_unknown(raw, {"table", "schema", "columns", "statuses", "dependencies", "instances", "read_table",
                              "dispatch", "install_sql", "related"}, "mapping")
        columns = TaskColumns(**_section(raw, "columns", TaskColumns))
        statuses_raw = _section(raw, "statuses", StatusValues)
        statuses_raw.pop("sets", None)
        statuses = StatusValues(**statuses_raw)
        deps = _section(raw, "dependencies", EdgesTable, extra={"mode"})
        mode = deps.pop("mode", "json")
        if mode in ("edges", "keys") and "table" not in deps:
            raise MappingError(f"mapping.dependencies.mode = {mode!r} needs mapping.dependencies.table")
        if "match" in deps and isinstance(deps["match"], list):
            deps["match"] = tuple(deps["match"])
        edges = EdgesTable(**deps) if mode in ("edges", "keys") else None
        if mode not in ("edges", "keys") and deps:
            raise MappingError("mapping.dependencies table/columns are only used with mode = 'edges' or 'keys'")
        dispatch = raw.get("dispatch") or {}
        if not isinstance(dispatch, Mapping):
            raise MappingError(f"mapping.dispatch must be a table, got {type(dispatch).__name__}")
        _reject_unknown(dispatch, {"attempt_moves", "set"}, "mapping.dispatch")
        dispatch_set = dispatch.get("set") or {}
        if not isinstance(dispatch_set, Mapping):
            raise MappingError("mapping.dispatch.set must be a table of column = \"now\" | \"increment\"")
        instances: InstancesTable | None = None
        if raw.get("instances") is not False:  # `instances = false`: the type is a task-table column
            # Validated even when unused, so a typo is reported rather than silently ignored.
            configured = InstancesTable(**_section(raw, "instances", InstancesTable))
            instances = None if columns.workflow_type is not None else configured
        related = raw.get("related") or ()
        if not isinstance(related, list | tuple):
            raise MappingError("mapping.related must be an array of tables ([[mapping.related]])")
        return cls(
            related=tuple(RelatedTable.from_dict(r) for r in related),
            table=raw.get("table", "tasks"),
            schema=raw.get("schema"),
            columns=columns,
            statuses=statuses,
            dependency_mode=mode,
            edges=edges,
            instances=instances,
            read_table=raw.get("read_table"),
            attempt_moves=dispatch.get("attempt_moves", "claim"),
            dispatch_set=tuple((str(k), v) for k, v in dispatch_set.items()),
            install_sql=raw.get("install_sql"),
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
