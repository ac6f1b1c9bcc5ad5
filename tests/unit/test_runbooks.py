"""The runbooks and ``pollbridge preflight`` come from one source, and every runbook step has its parts.

The format (also described in ``runbooks/00-overview.md``):

* A step is a heading ``## Step N.M: title`` (``### Step N.M.K: title`` inside an incident) followed by
  five fields, in this order, each a paragraph starting with its bold label: ``**Intent:**``,
  ``**Command:**`` (followed by a ```` ```console ```` block), ``**Expected:**``, ``**Gate:**`` and
  ``**Undo:**``.
* In a console block, ``$ `` starts a command; the lines after it are its expected output. A trailing
  ``&`` marks a service (a long-running process), a trailing comment ``# exit N`` the expected exit
  code (0 otherwise) and ``# until exit 0`` a command repeated until it passes. ``$ export NAME=value``
  sets ``$NAME`` for later commands.
* ``Checks: preflight a, b`` names preflight checks (in the Gate field).
* ``06-incidents.md`` groups steps under ``## Incident N.M: title`` headings, each with a
  ``Fault: name`` line (the fault the runbook walk injects) and steps titled ``Detect``, optionally
  ``Contain: ...``, ``Fix: ...`` and ``Verify``, in that order.

The parser below is also used by ``tests/acceptance/test_runbook_walk.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest

RUNBOOK_DIR = Path(__file__).resolve().parents[2] / "runbooks"
RUNBOOKS = ("00-overview", "01-install-alongside", "02-dual-write", "03-selective", "04-cutover", "05-rollback",
            "06-incidents", "07-scale-out")
FIELDS = ("Intent", "Command", "Expected", "Gate", "Undo")
#: Commands a runbook may show that are not ``pollbridge`` (the walk does not run them; the reason is the value).
EXTERNAL = {"python -m bench.capture": "a benchmark on a scratch database, from a source checkout (needs pgbench)"}
#: Variables the runbooks may use; each must be exported by a step before its first use.
VARIABLES = ("POLLBRIDGE_DATABASE_URL", "POLLBRIDGE_BUS_URL", "TYPE", "TASK_ID")

STEP = re.compile(r"^#{2,3} Step (?P<id>[0-9][0-9.]*): (?P<title>.+)$")
INCIDENT = re.compile(r"^## Incident (?P<id>[0-9][0-9.]*): (?P<title>.+)$")
FIELD = re.compile(r"^\*\*(?P<name>[A-Z][a-z]+):\*\*\s*(?P<rest>.*)$")
CHECKS = re.compile(r"^Checks: preflight (?P<names>.+)$")
FAULT = re.compile(r"^Fault: (?P<name>[a-z_]+)$")
VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class Command:
    """One ``$ `` line of a console block."""

    text: str  # the command, without annotations
    background: bool
    exit_code: int
    until_ok: bool
    output: list[str] = field(default_factory=list)
    comment: str = ""

    @property
    def is_pollbridge(self) -> bool:
        return self.text.startswith("pollbridge ")

    @property
    def export(self) -> tuple[str, str] | None:
        m = re.fullmatch(r"export ([A-Za-z_][A-Za-z0-9_]*)=(\S+)", self.text)
        return (m.group(1), m.group(2)) if m else None


@dataclass
class Step:
    runbook: str
    id: str
    title: str
    fields: dict[str, str] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    incident: str | None = None
    fault: str | None = None
    field_order: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.runbook} step {self.id} ({self.title})"


def _split_comment(line: str) -> tuple[str, str]:
    """``(command, comment)``: a ``#`` preceded by a blank and outside quotes starts the comment."""
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def parse_command(line: str) -> Command:
    text, comment = _split_comment(line)
    background = text.endswith(" &")
    if background:
        text = text[:-2].rstrip()
    exit_code, until_ok = 0, False
    if m := re.fullmatch(r"exit (\d+)(?:\b.*)?", comment):
        exit_code = int(m.group(1))
    elif comment.startswith("until exit 0"):
        until_ok = True
    return Command(text, background, exit_code, until_ok, comment=comment)


def parse_runbook(path: Path) -> list[Step]:
    steps: list[Step] = []
    step: Step | None = None
    incident: tuple[str, str] | None = None
    fault: str | None = None
    current_field: str | None = None
    in_console = in_block = False
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.rstrip()
        if in_block:
            if line.startswith("```"):
                in_block = in_console = False
            elif in_console and step is not None:
                if line.startswith("$ "):
                    step.commands.append(parse_command(line[2:]))
                elif step.commands:
                    step.commands[-1].output.append(line)
            continue
        if line.startswith("```"):
            in_block = True
            in_console = line.strip() == "```console"
            if in_console and step is not None and current_field != "Command":
                raise AssertionError(f"{step.name}: a console block outside the Command field")
            continue
        if m := INCIDENT.match(line):
            incident, fault, step, current_field = (m.group("id"), m.group("title")), None, None, None
            continue
        if line.startswith("## ") and not STEP.match(line):
            incident, fault, step, current_field = None, None, None, None
            continue
        if m := FAULT.match(line):
            fault = m.group("name")
            continue
        if m := STEP.match(line):
            step = Step(path.stem, m.group("id"), m.group("title"),
                        incident=f"{incident[0]}: {incident[1]}" if incident else None, fault=fault)
            steps.append(step)
            current_field = None
            continue
        if step is None:
            continue
        if m := FIELD.match(line):
            current_field = m.group("name")
            step.field_order.append(current_field)
            step.fields[current_field] = m.group("rest")
            continue
        if m := CHECKS.match(line):
            step.checks += [n.strip().strip("`") for n in m.group("names").split(",") if n.strip()]
        if current_field is not None:
            step.fields[current_field] = (step.fields[current_field] + "\n" + line).strip()
    return steps


def load_runbooks() -> dict[str, list[Step]]:
    """Every runbook's steps, in reading (and walking) order."""
    return {name: parse_runbook(RUNBOOK_DIR / f"{name}.md") for name in RUNBOOKS}


def all_steps() -> list[Step]:
    return [s for steps in load_runbooks().values() for s in steps]


def expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` replaced from ``variables`` (an unknown name is an error)."""
    def sub(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        if name not in variables:
            raise KeyError(f"variable ${name} is used before any step exports it")
        return variables[name]
    return VAR.sub(sub, text)


def preflight_phases(command: Command) -> list[str]:
    """The PHASE of a ``pollbridge preflight PHASE ...`` command (empty for any other command)."""
    words = shlex.split(command.text)
    if words[:2] == ["pollbridge", "preflight"] and len(words) > 2:
        return [words[2]]
    return []


# --- the CLI, for checking that commands parse ---------------------------------------------------------

def parse_cli(words: list[str]) -> click.Context:
    """Parse ``pollbridge`` arguments down to the leaf command, as the CLI would (without running it)."""
    from bridge.cli.main import cli

    assert words[0] == "pollbridge", words
    command: click.Command = cli
    name, args = "pollbridge", words[1:]
    parent: click.Context | None = None
    while True:
        ctx = command.make_context(name, list(args), parent=parent)
        if not isinstance(command, click.Group):
            return ctx
        protected = getattr(ctx, "_protected_args", None)
        rest = [*(protected if protected is not None else ctx.protected_args), *ctx.args]
        sub_name, sub, sub_args = command.resolve_command(ctx, rest)
        assert sub is not None and sub_name is not None, words
        command, name, args, parent = sub, sub_name, sub_args, ctx


# --- the tests -------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _no_pollbridge_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("POLLBRIDGE_"):
            monkeypatch.delenv(key)


def test_the_runbooks_are_there() -> None:
    found = sorted(p.stem for p in RUNBOOK_DIR.glob("*.md"))
    assert found == sorted(RUNBOOKS)
    books = load_runbooks()
    assert books["00-overview"] == [], "the overview has no steps of its own"
    for name in RUNBOOKS[1:]:
        assert books[name], f"{name} has no step"


def test_every_step_has_intent_command_expected_gate_and_undo() -> None:
    for step in all_steps():
        assert step.field_order == list(FIELDS), f"{step.name}: fields {step.field_order}, expected {FIELDS} in order"
        for name in FIELDS:
            if name != "Command":
                assert len(step.fields[name].strip()) >= 5, f"{step.name}: the {name} field is empty"
        assert step.commands, f"{step.name}: no `$ ` command in a console block"


def test_step_ids_are_unique_and_follow_their_runbook() -> None:
    seen: set[str] = set()
    for step in all_steps():
        assert step.id not in seen, f"step {step.id} appears twice"
        seen.add(step.id)
        assert step.id.split(".")[0] == str(int(step.runbook[:2])), f"{step.name}: id does not match the runbook"


def test_runbooks_name_only_checks_preflight_runs_and_name_every_check() -> None:
    from bridge.rollout.preflight import CHECKS, REGISTRY, checks_for

    named: set[str] = set()
    for step in all_steps():
        phases = [p for c in step.commands for p in preflight_phases(c)]
        for check in step.checks:
            assert check in REGISTRY, f"{step.name} names {check!r}, which preflight does not have"
            if phases:
                run = {c.name for p in phases for c in checks_for(p)}
                assert check in run, (f"{step.name} names {check!r}, which `preflight {' / '.join(phases)}` "
                                      "does not run")
            named.add(check)
    unnamed = [c.name for c in CHECKS if c.name not in named]
    assert not unnamed, f"preflight checks named in no runbook: {unnamed}"


def test_the_overview_matrix_is_the_registry() -> None:
    from bridge.core.phases import PHASES
    from bridge.rollout.preflight import CHECKS, matrix

    text = (RUNBOOK_DIR / "00-overview.md").read_text(encoding="utf-8")
    header = next(line for line in text.splitlines() if line.startswith("| check |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[1:5] == list(PHASES)
    rows: dict[str, dict[str, bool]] = {}
    for line in text.splitlines():
        if m := re.match(r"^\| `([a-z_]+)` \|", line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert all(c in ("✓", "") for c in cells[1:5]), line
            rows[m.group(1)] = {phase: cells[1 + i] == "✓" for i, phase in enumerate(PHASES)}
    assert list(rows) == [c.name for c in CHECKS], "the overview lists the checks in the registry's order"
    assert rows == matrix()


def test_the_preflight_docstring_matrix_is_the_registry() -> None:
    import bridge.rollout.preflight as preflight
    from bridge.core.phases import PHASES

    rows: dict[str, dict[str, bool]] = {}
    lines = (preflight.__doc__ or "").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("check "))
    header = lines[at]
    starts = [header.index(p) for p in PHASES]
    body = lines[at + 2:]
    for line in body[:next(i for i, line in enumerate(body) if line.startswith("==="))]:
        if m := re.match(r"^``([a-z_]+)``\s", line):
            rows[m.group(1)] = {p: line[s:s + len(p)].strip() == "yes" for p, s in zip(PHASES, starts, strict=True)}
    assert rows == preflight.matrix()


def test_polling_needs_only_the_database() -> None:
    from bridge.rollout.preflight import checks_for

    assert [c.name for c in checks_for("polling")] == ["database"]


def test_commands_are_pollbridge_exports_or_known_external_ones() -> None:
    for step in all_steps():
        for command in step.commands:
            if command.is_pollbridge or command.export:
                continue
            assert any(command.text.startswith(prefix) for prefix in EXTERNAL), \
                f"{step.name}: `{command.text}` is neither a pollbridge command nor a known external one"
            assert not command.background and not command.until_ok, step.name


def test_every_pollbridge_command_parses() -> None:
    """Console commands and the commands quoted in the text (Undo fields included) name real subcommands
    and options."""
    quoted = re.compile(r"`(pollbridge [^`]+)`")
    for step in all_steps():
        texts = [c.text for c in step.commands if c.is_pollbridge]
        for value in step.fields.values():
            texts += [m.group(1) for m in quoted.finditer(value)]
        for text in texts:
            words = shlex.split(text.replace("...", "x").replace("…", "x"))
            try:
                parse_cli(words)
            except click.ClickException as exc:
                raise AssertionError(f"{step.name}: `{text}` does not parse: {exc.format_message()}") from None


def test_services_are_run_commands() -> None:
    services = [c for s in all_steps() for c in s.commands if c.background]
    assert services
    for command in services:
        words = shlex.split(command.text)
        assert command.is_pollbridge and words[2:3] == ["run"], f"`{command.text}` is not a service"


def test_variables_are_exported_before_use() -> None:
    exported: set[str] = set()
    for step in all_steps():
        for command in step.commands:
            expand(command.text, {name: "x" for name in exported})  # raises for an unknown variable
            if command.export:
                name = command.export[0]
                assert name in VARIABLES, f"{step.name} exports {name}, not one of {VARIABLES}"
                exported.add(name)
    assert exported == set(VARIABLES)


def test_expected_exit_codes_are_documented_ones() -> None:
    for step in all_steps():
        for command in step.commands:
            assert command.exit_code in (0, 1, 2), step.name
            if command.until_ok:
                assert command.exit_code == 0 and not command.background, step.name


def test_incidents_have_a_fault_and_detect_fix_verify() -> None:
    from itertools import groupby

    steps = load_runbooks()["06-incidents"]
    assert all(s.incident for s in steps), "every step of 06-incidents belongs to an incident"
    faults = []
    for incident, group in groupby(steps, key=lambda s: s.incident):
        members = list(group)
        assert members[0].fault, f"incident {incident} has no `Fault:` line"
        faults.append(members[0].fault)
        kinds = [s.title.split(":")[0] for s in members]
        assert kinds[0] == "Detect" and kinds[-1] == "Verify" and "Fix" in kinds, (incident, kinds)
        assert all(k in ("Detect", "Contain", "Fix", "Verify") for k in kinds), (incident, kinds)
    assert len(faults) == len(set(faults)) == 7


def test_toml_snippets_are_valid_settings() -> None:
    from bridge.core.settings import settings_from_dict

    block = re.compile(r"```toml\n(.*?)```", re.S)
    for name in RUNBOOKS:
        for snippet in block.findall((RUNBOOK_DIR / f"{name}.md").read_text(encoding="utf-8")):
            settings_from_dict(tomllib.loads(snippet))


def test_preflight_lines_in_expected_output_name_real_checks() -> None:
    from bridge.rollout.preflight import REGISTRY

    for step in all_steps():
        for command in step.commands:
            for line in command.output:
                if (m := re.match(r"^\[(pass|FAIL)\] ([a-z_]+):", line)) and preflight_phases(command):
                    assert m.group(2) in REGISTRY, f"{step.name}: {line}"


def test_the_command_annotations_parse() -> None:
    c = parse_command('pollbridge flags set $TYPE dual_write --reason "a # in quotes"  # exit 1')
    assert (c.text, c.exit_code, c.background, c.until_ok) == (
        'pollbridge flags set $TYPE dual_write --reason "a # in quotes"', 1, False, False)
    c = parse_command("pollbridge relay run &")
    assert (c.text, c.background) == ("pollbridge relay run", True)
    c = parse_command("pollbridge preflight cutover --type $TYPE  # until exit 0")
    assert c.until_ok and c.exit_code == 0
    assert expand("--type $TYPE ${TYPE}x", {"TYPE": "orders"}) == "--type orders ordersx"
    with pytest.raises(KeyError):
        expand("$NOPE", {})
