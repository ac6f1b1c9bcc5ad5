"""The Grafana dashboard and the alert rules (dashboards/) match the code: schema, metric names, runbook links,
``promtool check rules`` when promtool is installed. The same checks as ``python dashboards/check.py``; and the
rules rendered by ``python dashboards/render_alerts.py`` link their runbooks absolutely."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

import pytest

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def _check() -> ModuleType:
    return _load("check")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"dashboards_{name}", DASHBOARDS / f"{name}.py")
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
                 "pollbridge_dispatch_latency_window_seconds_gcount", "pollbridge_dispatch_latency_window_seconds_gsum",
                 "pollbridge_fallback_misses_total", "pollbridge_guardian_demotions_total",
                 "pollbridge_serve_sse_clients"):
        assert name in known, name
    assert check.check_metric_names() == []


def test_a_gauge_named_like_a_histogram_or_counter_sample_is_caught(tmp_path: Path) -> None:
    """promtool check metrics refuses a gauge ``x_bucket`` (the windowed latency was one); the static check finds
    it in the code without a scrape."""
    check = _check()
    (tmp_path / "bridge").mkdir()
    (tmp_path / "bridge" / "m.py").write_text(
        'a = GaugeMetricFamily("pollbridge_x_seconds_bucket", "h", labels=["le"])\n'
        'b = Gauge("pollbridge_y_total", "h")\n'
        'c = GaugeHistogramMetricFamily("pollbridge_z_seconds", "h")\n'
        'd = Counter("pollbridge_w_total", "h")\n')
    problems = check.check_metric_names(tmp_path)
    assert len(problems) == 2, problems
    assert "pollbridge_x_seconds_bucket ends in _bucket" in problems[0]
    assert "pollbridge_y_total ends in _total" in problems[1]
    assert {"pollbridge_z_seconds_bucket", "pollbridge_z_seconds_gcount",
            "pollbridge_z_seconds_gsum"} <= check.known_metrics(tmp_path)


def test_the_rules_alert_when_a_pollbridge_target_or_the_status_metrics_are_gone() -> None:
    check = _check()
    rules = {r["alert"]: r["expr"] for r in check._alert_rules((DASHBOARDS / "alerts.yml").read_text())}
    assert rules["PollbridgeTargetDown"] == 'up{job=~"pollbridge.*"} == 0'
    assert rules["PollbridgeStatusAbsent"] == "absent(pollbridge_status_up)"
    assert rules["PollbridgeStatusUnavailable"] == "pollbridge_status_up == 0"


def test_rendered_rules_link_every_runbook_absolutely() -> None:
    check, render = _check(), _load("render_alerts")
    text = (DASHBOARDS / "alerts.yml").read_text()
    base = "https://git.example.com/ops/pollbridge/blob/v1.4.0"
    anchors = check.runbook_anchors()
    for given in (base, base + "/"):
        rendered = check._alert_rules(render.render(text, given))
        assert len(rendered) == len(check._alert_rules(text)) >= 10
        for rule in rendered:
            url = rule["runbook_url"]
            assert url.startswith(f"{base}/runbooks/06-incidents.md#"), (rule["alert"], url)
            assert urlsplit(url).scheme == "https" and urlsplit(url).fragment in anchors, url
    assert render.PLACEHOLDER not in "".join(r["runbook_url"] for r in check._alert_rules(render.render(text, base)))
    for bad in ("runbooks", "/srv/runbooks", "ftp://host/x", "https://host/x?ref=main", 'https://host/a"b'):
        with pytest.raises(render.RenderError):
            render.render(text, bad)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert render.main(["--runbook-base-url", base]) == 0
        assert render.main(["--runbook-base-url", "runbooks/"]) == 2
    assert out.getvalue() == render.render(text, base)
    assert "absolute http(s) URL" in err.getvalue()


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
        'runbook_url: "${RUNBOOK_BASE_URL}/runbooks/06-incidents.md#incident-64-dead-letters-growing"',
        'runbook_url: "https://example.invalid/"')
    (tmp_path / "alerts.yml").write_text(rules.replace("pollbridge_bus_lag", "pollbridge_bus_lagg"))
    problems = check.check_alerts(tmp_path / "alerts.yml", known, {"06-incidents"})
    assert any("PollbridgeDeadLettersGrowing: runbook_url" in p for p in problems), problems
    assert any("PollbridgeOutboxBacklogAge" in p and "names no heading" in p for p in problems), problems
    assert any("pollbridge_bus_lagg" in p for p in problems), problems


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_rules_as_written_and_as_rendered(tmp_path: Path) -> None:
    check = _check()
    assert check.check_promtool(DASHBOARDS / "alerts.yml", required=True) == []
    broken = tmp_path / "alerts.yml"  # what promtool refuses is reported
    broken.write_text((DASHBOARDS / "alerts.yml").read_text().replace(
        '"${RUNBOOK_BASE_URL}/runbooks/06-incidents.md#06-incidents"', '${RUNBOOK_BASE_URL}: x'))
    assert check.check_promtool(broken, required=True)
