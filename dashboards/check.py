"""Check the Grafana dashboard and the Prometheus alert rules against the code. Run: ``python dashboards/check.py``.

1. ``pollbridge.json`` validates against ``dashboard.schema.json`` (the Grafana essentials: title, uid, panels
   with a grid position, targets with a PromQL ``expr``), with a small validator for the JSON Schema keywords
   that schema uses (no dependency to install); panel ids are unique and panels do not overlap.
2. Every ``pollbridge_*`` metric named in a panel, an annotation or an alert rule exists: the known names are
   read from the code (every ``Counter(``/``Gauge(``/``Histogram(`` and collector family named ``pollbridge_*``,
   with the sample suffixes Prometheus gives each kind).
3. No gauge defined in the code has a name Prometheus reserves for other kinds (``_bucket``, ``_count``,
   ``_sum``, ``_total``): ``promtool check metrics`` refuses such a scrape.
4. Every alert rule has a ``runbook_url`` annotation ``${RUNBOOK_BASE_URL}/runbooks/06-incidents.md#...`` (the
   placeholder ``render_alerts.py`` replaces), at a heading that exists there (GitHub's anchor of the heading)
   when the runbook is present.
5. ``promtool check rules`` of ``alerts.yml`` and of its rendering by ``render_alerts.py`` when ``promtool`` is
   installed (Debian package ``prometheus``); ``--require-promtool`` makes its absence an error.

Exit 0 when everything holds, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CODE = ("bridge", "event_scheduler", "legacy_poller")


def _render_alerts() -> ModuleType:
    """``render_alerts.py`` beside this file (loaded by path: this script is run directly, or loaded by a test)."""
    spec = importlib.util.spec_from_file_location("dashboards_render_alerts", HERE / "render_alerts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_alerts = _render_alerts()
RUNBOOK_FILE = "runbooks/06-incidents.md"
#: How every runbook_url of alerts.yml starts (the placeholder is replaced when the rules are rendered).
RUNBOOK = f"{render_alerts.PLACEHOLDER}/{RUNBOOK_FILE}#"
#: The base URL the checks render the rules with (any absolute URL: promtool sees what Prometheus will load).
EXAMPLE_BASE_URL = "https://git.example.com/ops/pollbridge/blob/main"

#: A metric defined in the code: the constructor (or collector family) and its name.
_DEFINED = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|GaugeMetricFamily|CounterMetricFamily|HistogramMetricFamily"
    r"|GaugeHistogramMetricFamily|_gauge)\(\s*\"(pollbridge_[a-z0-9_]+)\"")
_SUFFIXES = {
    "Counter": ("_total", "_created"), "CounterMetricFamily": ("_total", "_created"),
    "Histogram": ("_bucket", "_count", "_sum", "_created"), "HistogramMetricFamily": ("_bucket", "_count", "_sum"),
    "GaugeHistogramMetricFamily": ("_bucket", "_gcount", "_gsum"),
    "Summary": ("", "_count", "_sum", "_created"),
}
_GAUGES = ("Gauge", "GaugeMetricFamily", "_gauge")
#: Sample suffixes Prometheus reserves for histograms, summaries and counters: never the end of a gauge's name.
_RESERVED = ("_bucket", "_count", "_sum", "_total")
_USED = re.compile(r"\b(pollbridge_[a-zA-Z0-9_]+)\b")


def known_metrics(root: Path = ROOT) -> set[str]:
    """Every sample name the code can expose (a Counter ``x`` is scraped as ``x_total``, ...)."""
    names: set[str] = set()
    for package in CODE:
        for path in sorted((root / package).rglob("*.py")):
            for kind, name in _DEFINED.findall(path.read_text(encoding="utf-8")):
                if kind in ("Counter", "CounterMetricFamily"):
                    base = name.removesuffix("_total")
                    names.update(base + s for s in _SUFFIXES[kind])
                elif kind in _SUFFIXES:
                    names.update(name + s for s in _SUFFIXES[kind])
                else:
                    names.add(name)
    return names


def check_metric_names(root: Path = ROOT) -> list[str]:
    """Gauges of the code whose name ends like a histogram's, a summary's or a counter's samples."""
    problems: list[str] = []
    for package in CODE:
        for path in sorted((root / package).rglob("*.py")):
            for kind, name in _DEFINED.findall(path.read_text(encoding="utf-8")):
                if kind in _GAUGES and name.endswith(_RESERVED):
                    suffix = next(s for s in _RESERVED if name.endswith(s))
                    problems.append(f"{path.relative_to(root)}: gauge {name} ends in {suffix}, which Prometheus "
                                    "reserves for a histogram's, summary's or counter's samples (promtool check "
                                    "metrics fails)")
    return problems


# --- a JSON Schema validator for the keywords dashboard.schema.json uses ----------------------------------

_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool,
                          "integer": int, "number": (int, float)}


def validate(instance: Any, schema: dict[str, Any], root: dict[str, Any], where: str = "$") -> Iterator[str]:
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"unsupported $ref {ref!r}")
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        yield from validate(instance, target, root, where)
        return
    kind = schema.get("type")
    if kind is not None:
        expected = _TYPES[kind]
        wrong = not isinstance(instance, expected) or (kind in ("integer", "number") and isinstance(instance, bool))
        if wrong:
            yield f"{where}: expected {kind}, got {type(instance).__name__}"
            return
    if "enum" in schema and instance not in schema["enum"]:
        yield f"{where}: {instance!r} is not one of {schema['enum']}"
    if isinstance(instance, str):
        if len(instance) < schema.get("minLength", 0):
            yield f"{where}: shorter than {schema['minLength']}"
        if "pattern" in schema and not re.search(schema["pattern"], instance):
            yield f"{where}: {instance!r} does not match {schema['pattern']}"
    if isinstance(instance, int | float) and not isinstance(instance, bool):
        if "minimum" in schema and instance < schema["minimum"]:
            yield f"{where}: {instance} < {schema['minimum']}"
        if "maximum" in schema and instance > schema["maximum"]:
            yield f"{where}: {instance} > {schema['maximum']}"
    if isinstance(instance, dict):
        for key in schema.get("required", ()):
            if key not in instance:
                yield f"{where}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                yield from validate(instance[key], sub, root, f"{where}.{key}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            yield f"{where}: fewer than {schema['minItems']} items"
        if "items" in schema:
            for i, item in enumerate(instance):
                yield from validate(item, schema["items"], root, f"{where}[{i}]")


# --- the checks -----------------------------------------------------------------------------------------

def _exprs(node: Any) -> Iterator[str]:
    """Every PromQL expression in the dashboard: targets, annotations, template queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            promql = key in ("expr", "definition") or (key == "query" and "(" in str(value))
            if promql and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def check_dashboard(path: Path, schema_path: Path, known: set[str]) -> list[str]:
    problems: list[str] = []
    try:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return [f"{path.name}: not JSON: {exc}"]
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    problems += [f"{path.name}: {p}" for p in validate(dashboard, schema, schema)]
    if problems:
        return problems
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)):
        problems.append(f"{path.name}: panel ids are not unique: {sorted(ids)}")
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        if g["x"] + g["w"] > 24:
            problems.append(f"{path.name}: panel {panel['title']!r} is wider than the grid")
        if panel["type"] != "row" and not panel.get("targets"):
            problems.append(f"{path.name}: panel {panel['title']!r} has no query")
        for x in range(g["x"], min(24, g["x"] + g["w"])):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    problems.append(f"{path.name}: panels {cells[(x, y)]!r} and {panel['title']!r} overlap")
                    break
                cells[(x, y)] = panel["title"]
            else:
                continue
            break
    for expr in _exprs(dashboard):
        for name in _USED.findall(expr):
            if name not in known:
                problems.append(f"{path.name}: unknown metric {name} in {expr!r}")
    return problems


def _alert_rules(text: str) -> list[dict[str, str]]:
    """``alert``, ``expr`` and ``runbook_url`` of each rule (the file's own layout: one rule per ``- alert:``)."""
    rules: list[dict[str, str]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("- alert:"):
            rules.append({"alert": stripped.split(":", 1)[1].strip()})
        elif rules and stripped.startswith(("expr:", "runbook_url:")):
            key, value = stripped.split(":", 1)
            rules[-1][key] = value.strip().strip('"')
    return rules


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def runbook_anchors(root: Path = ROOT) -> set[str] | None:
    path = root / RUNBOOK_FILE
    if not path.is_file():
        return None
    return {anchor(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def check_alerts(path: Path, known: set[str], anchors: set[str] | None = None) -> list[str]:
    problems: list[str] = []
    rules = _alert_rules(path.read_text(encoding="utf-8"))
    if not rules:
        return [f"{path.name}: no alert rule found"]
    for rule in rules:
        name = rule["alert"]
        if not rule.get("expr"):
            problems.append(f"{path.name}: {name}: no one-line expr")
        for metric in _USED.findall(rule.get("expr", "")):
            if metric not in known:
                problems.append(f"{path.name}: {name}: unknown metric {metric}")
        url = rule.get("runbook_url", "")
        if not url.startswith(RUNBOOK) or len(url) == len(RUNBOOK):
            problems.append(f"{path.name}: {name}: runbook_url must point into {RUNBOOK}<anchor>, got {url!r}")
        elif anchors is not None and url[len(RUNBOOK):] not in anchors:
            problems.append(f"{path.name}: {name}: {url} names no heading of the runbook")
    return problems


def check_promtool(path: Path, required: bool) -> list[str]:
    """``promtool check rules`` of the rules as written and as rendered (what Prometheus loads)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return ["promtool not found (apt-get install prometheus)"] if required else []
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        rendered = Path(tmp) / f"rendered-{path.name}"
        rendered.write_text(render_alerts.render(path.read_text(encoding="utf-8"), EXAMPLE_BASE_URL),
                            encoding="utf-8")
        for rules in (path, rendered):
            result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True,
                                    timeout=120)
            if result.returncode != 0:
                problems.append(f"promtool check rules {rules.name}: {(result.stdout + result.stderr).strip()}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require-promtool", action="store_true", help="fail when promtool is not installed")
    args = parser.parse_args(argv)
    known = known_metrics()
    problems = check_dashboard(HERE / "pollbridge.json", HERE / "dashboard.schema.json", known)
    problems += check_metric_names()
    problems += check_alerts(HERE / "alerts.yml", known, runbook_anchors())
    problems += check_promtool(HERE / "alerts.yml", args.require_promtool)
    for problem in problems:
        print(f"dashboards: {problem}", file=sys.stderr)
    if not problems:
        print(f"dashboards: pollbridge.json and alerts.yml OK ({len(known)} metric names known; promtool "
              f"{'ran' if shutil.which('promtool') else 'not installed, skipped'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
