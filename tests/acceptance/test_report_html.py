"""The HTML reconcile report as a person sees it: rendered in headless Chromium, measured by its computed boxes.

A copy of the report gets a small script that writes what the browser computed (the page's text, every
chart's text boxes, legend and y ticks, the verdicts' colors) into the DOM, and ``chromium --dump-dom``
prints it: no dependency beyond Debian's ``chromium`` package. Without it the tests skip, saying how to
install it; under ``POLLBRIDGE_REQUIRE_SERVICES=1`` (CI) they fail.

Proves: the page names the promotion each verdict judges; no time carries microseconds; every chart has a
legend; the timeline has at least three y ticks; no two text labels of a chart overlap, and none leaves
its chart, even for flag changes seconds apart in a half-hour window; a verdict other than pass and fail
("no evidence") is not the failure's color; a pass under relaxed per-type thresholds says so and does not
look like a pass at the defaults. Once on a report built in memory, once through ``pollbridge reconcile
--format html`` on a real database.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from datetime import UTC, datetime, timedelta
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from bridge.core.phases import Flag
from bridge.core.settings import GateSettings
from bridge.db.engine import create_engine
from bridge.flags.store import FlagChange, FlagStore
from bridge.reconcile.classify import COMPARED, PhaseSpan, miss_rate_upper
from bridge.reconcile.gate import FAIL, NO_EVIDENCE, PASS, judge
from bridge.reconcile.html import render_html
from bridge.reconcile.report import HISTOGRAM_EDGES_MS, TIMELINE_BUCKETS, Mismatch, Report, TypeReport
from tests.support import Run

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,2400")

# Writes what the browser computed into the page, for --dump-dom to print.
MEASURE = """<script>
(function () {
  function box(el) { var r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }
  function texts(nodes) { return Array.prototype.map.call(nodes, function (t) { return t.textContent; }); }
  var out = {text: document.body.innerText, charts: [], verdicts: [],
             overflow: document.documentElement.scrollWidth - window.innerWidth};
  document.querySelectorAll('svg').forEach(function (svg) {
    var section = svg.closest('section');
    out.charts.push({
      type: section ? section.dataset.type : null, kind: svg.getAttribute('class') || '', box: box(svg),
      legend: texts(svg.querySelectorAll('g.legend text')), yticks: texts(svg.querySelectorAll('text.ytick')),
      texts: Array.prototype.map.call(svg.querySelectorAll('text'),
                                      function (t) {
                                        return {text: t.textContent, cls: t.getAttribute('class') || '', box: box(t)};
                                      })});
  });
  document.querySelectorAll('[data-verdict]').forEach(function (v) {
    var holder = v.closest('[data-type]'), style = getComputedStyle(v);
    out.verdicts.push({type: holder ? holder.dataset.type : null, verdict: v.dataset.verdict, text: v.textContent,
                       color: style.color, background: style.backgroundColor, outline: style.outlineStyle});
  });
  var pre = document.createElement('pre');
  pre.id = 'pb-measure';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""

GATES = GateSettings(min_tasks=100, miss_budget=0.01)
RELAXED = {"min_tasks": 20.0, "miss_budget": 0.2}
SINCE = datetime(2026, 11, 29, 14, 0, 0, 123456, tzinfo=UTC)
UNTIL = SINCE + timedelta(minutes=30, microseconds=654321)
MICROSECONDS = re.compile(r"\d{2}:\d{2}:\d{2}[.,]\d")


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        message = "headless Chromium is not installed: apt-get install chromium"
        if os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message} (POLLBRIDGE_REQUIRE_SERVICES=1: services are required)", pytrace=False)
        pytest.skip(message)
    return exe


def _measure(report_html: str, folder: Path) -> dict[str, Any]:
    """Render ``report_html`` (with the measuring script) in headless Chromium and return what it measured."""
    assert "<script" not in report_html  # the report has none; only the copy measured here does
    page = folder / "measured.html"
    page.write_text(report_html.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="pb-chromium-") as profile:
        done = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                               page.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="pb-measure">(.*?)</pre>', done.stdout, re.S)
    assert found, f"chromium printed no measurement (exit {done.returncode}): {done.stderr[-2000:]}"
    measured: dict[str, Any] = json.loads(html.unescape(found.group(1)))
    return measured


def _overlap(a: list[float], b: list[float]) -> float:
    """The area two boxes (left, top, right, bottom) share."""
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def _check_charts(measured: dict[str, Any], types: set[str]) -> None:
    """Every chart: a legend, no two labels overlapping, every label inside it; the timeline's y ticks."""
    charts = measured["charts"]
    assert {(c["type"], c["kind"]) for c in charts} == {(t, k) for t in types
                                                        for k in ("chart cdf", "chart timeline")}
    for chart in charts:
        where = f"{chart['type']} {chart['kind']}"
        assert len(chart["legend"]) >= 2, f"{where}: no legend"
        if chart["kind"] == "chart timeline":
            assert any("flag change" in text for text in chart["legend"]), where
            assert len(chart["yticks"]) >= 3, f"{where}: y ticks {chart['yticks']}"
            assert sorted(float(v) for v in chart["yticks"]) == [float(v) for v in chart["yticks"]]
        else:
            assert any(text.startswith(("poller", "event path")) for text in chart["legend"]), where
        left, top, right, bottom = chart["box"]
        for label in chart["texts"]:
            x0, y0, x1, y1 = label["box"]
            assert x1 > x0 and y1 > y0, f"{where}: {label['text']!r} is not drawn"
            assert left <= x0 and x1 <= right and top <= y0 and y1 <= bottom, \
                f"{where}: {label['text']!r} at {label['box']} leaves the chart {chart['box']}"
        for a, b in combinations(chart["texts"], 2):
            assert _overlap(a["box"], b["box"]) < 1.0, \
                f"{where}: {a['text']!r} {a['box']} overlaps {b['text']!r} {b['box']}"


def _no_microseconds(report_html: str, measured: dict[str, Any]) -> None:
    assert not MICROSECONDS.search(measured["text"]), MICROSECONDS.search(measured["text"])
    assert not MICROSECONDS.search(report_html)  # the title and attributes too


# --- a report built in memory: every case at once ---------------------------------------------------------
def _type(name: str, phase: str, counts: dict[str, int], thresholds: dict[str, float] | None = None,
          busy: bool = True) -> TypeReport:
    compared = sum(counts.get(k, 0) for k in COMPARED)
    width = len(HISTOGRAM_EDGES_MS) + 1
    return TypeReport(
        workflow_type=name, phase=phase, phases=(PhaseSpan(name, phase, None, None),), counts=counts,
        latency_ms={"poller": {"p50": 2100.0, "p90": 5000.0, "p99": 9000.0, "max": 9900.0, "n": 400},
                    "events": {"p50": 30.0, "p90": 80.0, "p99": 150.0, "max": 160.0, "n": 400}} if busy else {},
        criteria=judge(counts, compared, Flag(name, thresholds=thresholds or {}), GATES),
        miss_rate_upper=miss_rate_upper(counts.get("missing", 0), compared, GATES.confidence),
        histogram={"poller": [min(400, 25 * i) for i in range(width)],
                   "events": [min(400, 90 * i) for i in range(width)]} if busy else {},
        timeline={"poller": [i % 7 + 3 for i in range(TIMELINE_BUCKETS)],
                  "events": [(i * 3) % 11 for i in range(TIMELINE_BUCKETS)]} if busy else {})


def _change(n: int, name: str, old: str, new: str, at: datetime, *, action: str = "set",
            percent: float | None = None) -> FlagChange:
    return FlagChange(id=n, workflow_type=name, action=action, actor="alice", reason="step", old_phase=old,
                      new_phase=new, old_percent=None, new_percent=percent, forced=False, gate=None, changed_at=at)


def _report() -> Report:
    types = (
        _type("invoices", "selective", {"matched": 60, "missing": 1}, thresholds=RELAXED),
        _type("orders", "dual_write", {"matched": 400, "poller": 40}),
        _type("payouts", "selective", {"matched": 300, "missing": 40, "duplicate": 1}),
        _type("refunds", "dual_write", {"poller": 12}, busy=False),  # no compared task: no evidence
    )
    # Five changes of orders within 30 s of a 30 min window (a pixel or two apart), one of payouts at the
    # right edge; all with microseconds.
    burst = SINCE + timedelta(minutes=10, seconds=3, microseconds=4567)
    steps = [("polling", "dual_write", "set", None), ("dual_write", "selective", "set", 25.0),
             ("selective", "polling", "rollback", None), ("polling", "dual_write", "set", None),
             ("dual_write", "selective", "set", 25.0)]
    changes = [_change(i + 1, "orders", old, new, burst + timedelta(seconds=6 * i, microseconds=111), action=action,
                       percent=percent) for i, (old, new, action, percent) in enumerate(steps)]
    changes.append(_change(9, "payouts", "dual_write", "selective", UNTIL - timedelta(seconds=4), percent=10.0))
    mismatch = Mismatch("17", "payouts", "missing", "the poller's fallback dispatched it 5210 ms after readiness")
    return Report(SINCE, UNTIL, types, (mismatch,), tuple(changes))


def test_report_reads_right_in_chromium(tmp_path: Path) -> None:
    report = _report()
    assert [t.verdict for t in report.types] == [PASS, PASS, FAIL, NO_EVIDENCE]
    text = render_html(report, gates=GATES, thresholds={"invoices": RELAXED})
    measured = _measure(text, tmp_path)
    page = measured["text"]

    assert measured["overflow"] <= 0, "the page is wider than the window"
    # Which promotion each verdict judges.
    assert "Judges: dual_write → selective" in page and "Judges: selective → cutover" in page
    # Times to the second, in UTC.
    _no_microseconds(text, measured)
    assert "2026-11-29 14:00:00 UTC to 2026-11-29 14:30:00 UTC" in page
    for n, second in enumerate(("03", "09", "15", "21", "27"), start=1):
        assert f"2026-11-29 14:10:{second} UTC" in page, n
    _check_charts(measured, {"invoices", "orders", "payouts", "refunds"})
    orders = next(c for c in measured["charts"] if c["type"] == "orders" and c["kind"] == "chart timeline")
    assert sorted(t["text"].split()[0] for t in orders["texts"] if t["cls"] == "flag") == ["1", "2", "3", "4", "5"]

    verdicts: dict[tuple[str | None, str], dict[str, Any]] = {}
    for v in measured["verdicts"]:
        verdicts.setdefault((v["type"], v["verdict"]), v)  # the table's row; the section's is the same
    fail, quiet = verdicts[("payouts", FAIL)], verdicts[("refunds", NO_EVIDENCE)]
    assert quiet["color"] != fail["color"], "a verdict without evidence looks like a failure"
    assert quiet["text"] == "no evidence"
    plain, relaxed = verdicts[("orders", PASS)], verdicts[("invoices", PASS)]
    assert "relaxed" in relaxed["text"] and "relaxed" not in plain["text"]
    assert (relaxed["background"], relaxed["outline"]) != (plain["background"], plain["outline"])
    assert "per-type threshold min_tasks 20; default 100" in page
    assert "per-type threshold miss_budget 20%; default 1%" in page


# --- the same checks through the command line, on a real database -----------------------------------------
def test_cli_report_reads_right_in_chromium(pollbridge: Run, sqlite_url: str, tmp_path: Path) -> None:
    _chromium()
    engine = create_engine(sqlite_url)
    try:
        store = FlagStore(engine)
        for phase, percent in (("dual_write", None), ("selective", 10.0), ("polling", None), ("dual_write", None),
                               ("selective", 25.0), ("dual_write", None)):
            store.change("orders", phase, actor="alice", reason="flapping", percent=percent)
    finally:
        engine.dispose()
    out = tmp_path / "r.html"
    done = pollbridge("reconcile", "--type", "orders", "--since", "10m", "--format", "html", "--output", str(out),
                      env={"POLLBRIDGE_DATABASE_URL": sqlite_url})
    assert done.returncode == 0, done.stderr
    text = out.read_text(encoding="utf-8")
    measured = _measure(text, tmp_path)
    assert "Judges: dual_write → selective" in measured["text"]
    _no_microseconds(text, measured)
    _check_charts(measured, {"orders"})
    (timeline,) = [c for c in measured["charts"] if c["kind"] == "chart timeline"]
    assert [t["text"].split()[0] for t in timeline["texts"] if t["cls"] == "flag"] == ["1", "2", "3", "4", "5", "6"]
    # No compared task: no evidence, in amber, not the failure red (#c23030).
    shown = {(v["verdict"], v["text"], v["color"]) for v in measured["verdicts"] if v["type"] == "orders"}
    ((verdict, label, color),) = shown
    assert (verdict, label) == (NO_EVIDENCE, "no evidence") and color != "rgb(194, 48, 48)", shown
