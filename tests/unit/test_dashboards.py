"""The Grafana dashboard and the alert rules (dashboards/) match the code: schema, metric names, runbook links,
``promtool check rules`` when promtool is installed. The same checks as ``python dashboards/check.py``."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_check", DASHBOARDS / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dashboard_and_the_alerts_pass_every_check() -> None:
    check = _check()
    known = check.known_metrics()
    assert check.check_dashboard(DASHBOARDS / "pollbridge.json", DASHBOARDS / "dashboard.schema.json", known) == []
    assert check.check_alerts(DASHBOARDS / "alerts.yml", known, check.runbook_anchors()) == []
    assert check.anchor(" Incident 6.1: Relay stuck or backlog growing") == "incident-61-relay-stuck-or-backlog-growing"
    for name in ("pollbridge_phase", "pollbridge_scheduler_dispatches_total",
                 "pollbridge_ready_to_dispatch_seconds_bucket", "pollbridge_dispatch_latency_window_seconds_bucket",
                 "pollbridge_fallback_misses_total", "pollbridge_guardian_demotions_total",
                 "pollbridge_serve_sse_clients"):
        assert name in known, name


def test_the_checks_catch_an_unknown_metric_a_bad_panel_and_a_missing_runbook(tmp_path: Path) -> None:
    check = _check()
    known = check.known_metrics()
    dashboard = json.loads((DASHBOARDS / "pollbridge.json").read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = "sum(pollbridge_no_such_metric_total)"
    del dashboard["panels"][2]["gridPos"]
    broken = tmp_path / "pollbridge.json"
    broken.write_text(json.dumps(dashboard))
    problems = check.check_dashboard(broken, DASHBOARDS / "dashboard.schema.json", known)
    assert any("gridPos" in p for p in problems), problems
    dashboard["panels"][2]["gridPos"] = {"x": 0, "y": 1, "w": 12, "h": 8}  # now it overlaps panel 2
    broken.write_text(json.dumps(dashboard))
    problems = check.check_dashboard(broken, DASHBOARDS / "dashboard.schema.json", known)
    assert any("pollbridge_no_such_metric_total" in p for p in problems), problems
    assert any("overlap" in p for p in problems), problems
    rules = (DASHBOARDS / "alerts.yml").read_text().replace(
        'runbook_url: "runbooks/06-incidents.md#incident-64-dead-letters-growing"', 'runbook_url: "https://example.invalid/"')
    (tmp_path / "alerts.yml").write_text(rules.replace("pollbridge_bus_lag", "pollbridge_bus_lagg"))
    problems = check.check_alerts(tmp_path / "alerts.yml", known, {"06-incidents"})
    assert any("PollbridgeDeadLettersGrowing: runbook_url" in p for p in problems), problems
    assert any("PollbridgeOutboxBacklogAge" in p and "names no heading" in p for p in problems), problems
    assert any("pollbridge_bus_lagg" in p for p in problems), problems


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_rules() -> None:
    assert _check().check_promtool(DASHBOARDS / "alerts.yml", required=True) == []
