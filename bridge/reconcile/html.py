"""The reconcile report as one self-contained HTML file: no script, no external asset, inline SVG charts.

Per workflow type: the counts and verdict table (with the promotion each verdict judges), the noise floor
(the legacy poller's late and missing share beside the event path's), the latency CDF of both paths (log
scale), and the actions over the window by path with the flag changes drawn (numbered, and listed under the
chart) on the timeline; then the mismatches with their explanation. Every text that comes from the database
is escaped. A control report (``--control``) says in its heading that it measures the legacy poller, and its
verdict ``floor`` is drawn neutral (blue-grey): neither the pass green nor the fail red.

Made to be read, as checked in a browser (``tests/acceptance/test_report_html.py`` renders it in headless
Chromium): every chart has a legend; chart text is monospace, so the layout can measure it, and flag
labels that would collide go to further rows; a verdict other than pass and fail (no evidence yet) is
amber, not the failure red; a pass under relaxed per-type thresholds says so; times are to the second,
in UTC.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from bridge.core.phases import PHASES
from bridge.core.settings import GateSettings
from bridge.db.clock import as_utc
from bridge.flags.store import FlagChange
from bridge.reconcile.gate import FAIL, FLOOR, PASS, gap_detail
from bridge.reconcile.report import (
    HISTOGRAM_EDGES_MS,
    TIMELINE_BUCKETS,
    PathShare,
    Report,
    TypeReport,
    duration_text,
)

COLORS = {"poller": "#d9822b", "events": "#2b7bd9", "fallback": "#c23030", "decision": "#6b6b6b"}
PATH_LABELS = {"poller": "poller", "events": "event path", "fallback": "fallback/sweep",
               "decision": "shadow decision only"}
PATH_ORDER = ("poller", "events", "decision", "fallback")
MARKER = "#555"
#: What the heading adds in a control report: it measures the legacy poller, it does not judge the event path.
CONTROL_TITLE = " — control: the legacy poller&#39;s noise floor"

W = 560                     # every chart's width
LEFT, RIGHT = 52, W - 16    # the plot's x extent (y tick labels end left of LEFT)
TICK, SMALL, TITLE = 10, 10, 12   # font sizes
CHAR = 0.62                 # width of a monospace character, in em (DejaVu Sans Mono: 0.602)
ROW = 14                    # height of a row of labels
GAP = 6                     # the least horizontal room between two labels
MAX_LABEL_ROWS = 4          # flag labels in full up to this many rows, then numbers only
MAX_NUMBER_ROWS = 12        # numbers up to this many rows, then unlabelled (the list under the chart has them)

#: Per-type thresholds that the report's verdict applies, the criterion each one sets, and which way is
#: laxer than the default.
GATE_THRESHOLDS: dict[str, tuple[str, int]] = {"min_tasks": ("min_tasks", -1), "miss_budget": ("miss_rate", +1)}

CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}p{max-width:75em}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 4px;
text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}td.nw{white-space:nowrap}
.v{font-weight:bold;padding:0 .3em;border-radius:3px}
.v-pass{color:#1a7f37}.v-fail{color:#c23030}.v-open{color:#7a4d00;background:#fff1c2}
.v-relaxed{color:#1a7f37;background:#fff1c2;outline:1px dashed #b7791f}
.v-floor{color:#2c4a6b;background:#e4edf7}
table.floor td.share{font-weight:bold}table.floor tr.legacy td{background:#fbf4ec}code{white-space:nowrap}
li.c-pass{color:#1a7f37}li.c-fail{color:#c23030}li.c-open{color:#7a4d00}
.charts{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}
svg{background:#fafafa;border:1px solid #ddd}svg text{font-family:ui-monospace,'DejaVu Sans Mono',monospace}
small,.note{color:#555}ol.changes{font-size:14px;margin:.3em 0 1em}
"""


def render_html(report: Report, *, gates: GateSettings | None = None,
                thresholds: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """The report as HTML. ``gates``: the ``[gates]`` settings the verdicts used, the defaults (as in
    :func:`~bridge.reconcile.report.build_report`, ``GateSettings()`` when not given); ``thresholds``: each
    type's own overrides (its flag's ``thresholds``), so that a pass under laxer ones says so."""
    overrides = thresholds or {}
    window = f"{_ts(report.since)} to {_ts(report.until)}"
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>pollbridge reconcile {escape(window)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>pollbridge reconcile{CONTROL_TITLE if report.control else ''}</h1>",
        f"<p>Window {escape(window)} ({escape(_duration((report.until - report.since).total_seconds()))}). "
        f"Verdict: {_badge(report.verdict, report.verdict.upper())}</p>",
        f"<p class='note'>{escape(_judges_note(report, gates))}</p>",
        *([f"<p class='gaps' data-capture-gaps='{len(report.capture_gaps)}'><b>Capture gaps:</b> "
           f"{escape(gap_detail(report.capture_gaps))}.</p>"] if report.capture_gaps else []),
        _summary_table(report, gates, overrides),
        _floor_table(report, gates),
    ]
    for t in report.types:
        relaxed = _relaxed(t, gates, overrides.get(t.workflow_type, {}))
        parts.append(f"<section data-type='{escape(t.workflow_type, quote=True)}'>")
        parts.append(f"<h2>{escape(t.workflow_type)} <small>phase {escape(t.phase)}</small> "
                     f"{_verdict(t, relaxed)}</h2>")
        parts.append(f"<p>Judges: <b>{escape(_promotion(report, t))}</b></p>")
        if t.criteria:
            parts.append(_criteria(t, gates, overrides.get(t.workflow_type, {})))
        changes = [c for c in report.flag_changes if c.workflow_type == t.workflow_type]
        parts.append("<div class='charts'>" + _cdf_svg(t) + _timeline_svg(report, t, changes) + "</div>")
        if changes:
            parts.append(_changes_list(changes))
        parts.append("</section>")
    parts.append(_mismatch_table(report))
    parts.append("</body></html>")
    return "\n".join(parts)


# --- verdicts, thresholds, the promotion judged ----------------------------------------------------------
def _style(verdict: str) -> str:
    """``pass``, ``fail``, ``floor`` (a control report: measured, not judged), or ``open`` for any other
    verdict (``no_evidence``: not a failure, not a pass)."""
    return {PASS: "pass", FAIL: "fail", FLOOR: "floor"}.get(verdict, "open")


def _badge(verdict: str, text: str, style: str | None = None, why: str = "") -> str:
    title = f" title='{escape(why, quote=True)}'" if why else ""
    return (f"<span class='v v-{style or _style(verdict)}' data-verdict='{escape(verdict, quote=True)}'{title}>"
            f"{escape(text.replace('_', ' '))}</span>")


def _verdict(t: TypeReport, relaxed: list[str], *, short: bool = False) -> str:
    if t.verdict == PASS and relaxed:
        return _badge(t.verdict, f"{PASS} (relaxed{'' if short else ' thresholds'})", "relaxed", "; ".join(relaxed))
    return _badge(t.verdict, t.verdict)


def _relaxed(t: TypeReport, gates: GateSettings | None, own: Mapping[str, float]) -> list[str]:
    """The type's thresholds that are laxer than the defaults, as text (empty: none, or not known)."""
    if not t.criteria:
        return []
    out = []
    for name, (_criterion, laxer) in GATE_THRESHOLDS.items():
        if name not in own:
            continue
        value = float(own[name])
        default = float(getattr(gates or GateSettings(), name))
        if (value - default) * laxer > 0:
            out.append(f"{name} {_threshold(name, value)} (default {_threshold(name, default)})")
    return out


def _threshold(name: str, value: float) -> str:
    return f"{value:.4g}" if name == "min_tasks" else f"{value * 100:.4g}%"


def _promotion(report: Report, t: TypeReport) -> str:
    """The promotion the type's verdict is the evidence for: from its phase at the window's end."""
    if report.control:
        return "no promotion: the legacy poller measured (--control), the floor the event path is compared against"
    if not t.criteria:
        return "nothing: the type was in polling the whole window (no event path to judge)"
    if t.phase not in PHASES:
        return f"the evidence of phase {t.phase}"
    if t.phase == "polling":
        return "nothing yet: back in polling at the window's end (the evidence is of its earlier phases)"
    if t.phase == "cutover":
        return "cutover holding (the last phase: no further promotion)"
    following = PHASES[PHASES.index(t.phase) + 1]
    also = " (or a higher percentage)" if t.phase == "selective" else ""
    return f"{t.phase} → {following}{also}"


def _judges_note(report: Report, gates: GateSettings | None) -> str:
    if report.control:
        return ("Control: the legacy poller's own dispatches judged by the same rules against the task table "
                "(late past the objective, early, duplicate, and the ready tasks nobody dispatched). This is the "
                "noise floor the event path is compared against: the verdict is 'floor', never pass or fail, and "
                "no promotion gate applies.")
    text = ("Each verdict judges the promotion out of the type's phase at the window's end (the gate of "
            "`pollbridge flags set`), over the whole window: enough compared tasks, no early and no duplicate "
            "action, the upper confidence bound of the miss rate under the budget.")
    if gates is not None:
        text += (f" Defaults: min_tasks {_threshold('min_tasks', gates.min_tasks)}, miss_budget "
                 f"{_threshold('miss_budget', gates.miss_budget)}, confidence {gates.confidence:.0%}.")
    return text


def _criteria(t: TypeReport, gates: GateSettings | None, own: Mapping[str, float]) -> str:
    unmet = "fail" if t.verdict == FAIL else "open"  # no evidence yet: not met, not failed
    items = []
    for c in t.criteria:
        note = ""
        for name, (criterion, _laxer) in GATE_THRESHOLDS.items():
            if criterion == c.name and name in own:
                default = float(getattr(gates or GateSettings(), name))
                note = (f" (per-type threshold {name} {_threshold(name, float(own[name]))}; "
                        f"default {_threshold(name, default)})")
        items.append(f"<li class='c-{'pass' if c.passed else unmet}'>{escape(c.name)}: {escape(c.detail)}"
                     f"{escape(note)}</li>")
    return "<ul>" + "".join(items) + "</ul>"


#: The summary table's count columns (kind, header); the backpressure kinds only when a type has one (two more
#: columns pushed a report of long type names past a 1280 px window).
SUMMARY_KINDS = (("matched", "matched"), ("missing", "missing"), ("extra", "extra"), ("duplicate", "duplicate"),
                 ("early", "early"), ("late", "late"), ("held", "held"), ("pending", "pending"),
                 ("on_hold", "on hold"))
HOLD_KINDS = ("held", "on_hold")


def _summary_table(report: Report, gates: GateSettings | None, overrides: Mapping[str, Mapping[str, float]]) -> str:
    held = any(t.counts.get(k, 0) for t in report.types for k in HOLD_KINDS)
    kinds = [(k, label) for k, label in SUMMARY_KINDS if held or k not in HOLD_KINDS]
    head = ("<tr><th class='l'>type</th><th class='l'>phase → promotion judged</th><th class='l'>verdict</th>"
            "<th>tasks</th><th>compared</th>" + "".join(f"<th>{label}</th>" for _k, label in kinds)
            + "<th>poller p50/p99 ms</th><th>events p50/p99 ms</th><th>miss upper 95%</th></tr>")
    rows = []
    for t in report.types:
        c = t.counts
        relaxed = _relaxed(t, gates, overrides.get(t.workflow_type, {}))
        rows.append(
            f"<tr data-type='{escape(t.workflow_type, quote=True)}'><td class='l'>{escape(t.workflow_type)}</td>"
            f"<td class='l nw'>{escape(_promotion_short(report, t))}</td>"
            f"<td class='l nw'>{_verdict(t, relaxed, short=True)}</td>"
            f"<td>{sum(c.values())}</td><td>{t.compared}</td>"
            + "".join(f"<td>{c.get(k, 0)}</td>" for k, _label in kinds)
            + f"<td>{_p(t, 'poller')}</td><td>{_p(t, 'events')}</td>"
            f"<td>{f'{t.miss_rate_upper:.4%}' if t.compared else '-'}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _floor_table(report: Report, gates: GateSettings | None) -> str:
    """The noise floor per type: the legacy poller's late and missing share (as ``--control`` judges it)
    beside the event path's, each of what that path was judged on in the window."""
    rows = []
    for t in report.types:
        shares = [("legacy", "poller (floor)", t.floor), ("events", "event path", t.event_path)]
        if not any(share for _cls, _label, share in shares):
            continue
        for i, (cls, label, share) in enumerate(shares):
            head = (f"<td class='l' rowspan='2'>{escape(t.workflow_type)}</td>" if i == 0 else "")
            rows.append(f"<tr class='{cls}' data-type='{escape(t.workflow_type, quote=True)}' data-path='{cls}'>"
                        f"{head}<td class='l'>{label}</td>{_share_cells(share)}</tr>")
    if not rows:
        return ""
    objective = duration_text((gates or GateSettings()).objective * 1000.0)
    head = ("<tr><th class='l'>type</th><th class='l'>path</th><th>judged</th><th>late</th><th>late share</th>"
            "<th>missing</th><th>missing share</th><th>held</th><th>p50</th></tr>")
    return (f"<h2>Noise floor beside the event path</h2><p class='note'>Late: past the objective ({objective}). "
            "The legacy poller's row is its floor: its own dispatches and the ready tasks nobody dispatched, "
            "judged as <code>--control</code> judges them. The event path's row is of its compared attempts; "
            "held: dispatched past the objective after a backpressure hold, neither late nor a miss.</p>"
            f"<table class='floor'>{head}{''.join(rows)}</table>")


def _share_cells(share: PathShare | None) -> str:
    if share is None:
        return "<td colspan='7' class='l note'>nothing of this path judged in the window</td>"
    p50 = duration_text(share.p50_ms) if share.p50_ms is not None else "-"
    return (f"<td>{share.judged}</td><td>{share.late}</td><td class='share'>{share.late_share:.1%}</td>"
            f"<td>{share.missing}</td><td class='share'>{share.missing_share:.1%}</td>"
            # Holds are the event scheduler's: the legacy path has none to count.
            f"<td>{share.held if share.path == 'events' else '-'}</td>"
            f"<td>{escape(p50)}</td>")


def _promotion_short(report: Report, t: TypeReport) -> str:
    full = _promotion(report, t)
    if "→" in full:
        return full.replace(" (or a higher percentage)", " or more %")
    if report.control:
        return f"{t.phase} (control: not judged)"
    return f"{t.phase} (holding)" if t.phase == "cutover" else f"{t.phase} (nothing to judge)"


def _p(t: TypeReport, path: str) -> str:
    stats = t.latency_ms.get(path)
    if not stats:
        return "-"
    return f"{_num(stats['p50'])} / {_num(stats['p99'])}"


def _num(value: float) -> str:
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


# --- chart layout -----------------------------------------------------------------------------------------
def _width(text: str, size: float) -> float:
    """The width of ``text`` in the charts' monospace font, a little generously."""
    return len(text) * CHAR * size


def _text(x: float, y: float, text: str, *, size: float = TICK, anchor: str = "start", fill: str = "#222",
          cls: str = "", halo: bool = False) -> str:
    extra = f" class='{cls}'" if cls else ""
    if halo:
        extra += " paint-order='stroke' stroke='#fafafa' stroke-width='4' stroke-linejoin='round'"
    return (f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' fill='{fill}'{extra}>"
            f"{escape(text)}</text>")


@dataclass(frozen=True)
class _Item:
    label: str
    color: str
    dashed: bool = False


def _legend(items: Sequence[_Item], top: float) -> tuple[str, float]:
    """A legend in rows from ``top``: a line sample and a label per item. Returns the SVG and its bottom."""
    out = ["<g class='legend'>"]
    x, y = float(LEFT), top + ROW / 2
    for item in items:
        width = 18 + 5 + _width(item.label, SMALL)
        if x + width > W - 8 and x > LEFT:
            x, y = float(LEFT), y + ROW
        dash = " stroke-dasharray='4 3'" if item.dashed else ""
        out.append(f"<line x1='{x:.1f}' y1='{y:.1f}' x2='{x + 18:.1f}' y2='{y:.1f}' stroke='{item.color}' "
                   f"stroke-width='2'{dash}/>")
        out.append(_text(x + 23, y + 3.5, item.label, size=SMALL))
        x += width + 16
    out.append("</g>")
    return "".join(out), y + ROW / 2


def _paths(present: Sequence[str]) -> list[str]:
    """The paths to show: always the poller and the event path, then whatever else has data, in a fixed order."""
    shown = {"poller", "events", *present}
    return [p for p in PATH_ORDER if p in shown] + sorted(shown - set(PATH_ORDER))


def _cdf_svg(t: TypeReport) -> str:
    """Cumulative share of tasks acted on within x ms, per path, x on a log scale."""
    top, bottom = 34.0, 204.0
    lo, hi = math.log10(HISTOGRAM_EDGES_MS[0]), math.log10(HISTOGRAM_EDGES_MS[-1])

    def x(ms: float) -> float:
        return LEFT + (math.log10(ms) - lo) / (hi - lo) * (RIGHT - LEFT)

    def y(share: float) -> float:
        return bottom - share * (bottom - top)

    out = [_text(8, 18, "ready → action latency: share of tasks within (CDF)", size=TITLE, cls="title")]
    for edge in (1, 10, 100, 1_000, 10_000, 100_000):
        out.append(f"<line x1='{x(edge):.1f}' y1='{y(0):.1f}' x2='{x(edge):.1f}' y2='{y(1):.1f}' stroke='#e3e3e3'/>")
        out.append(_text(x(edge), bottom + 16, f"{edge} ms" if edge == 1 else
                         (str(edge) if edge < 1000 else f"{edge // 1000} s"), anchor="middle", cls="xtick"))
    for share in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0):
        out.append(f"<line x1='{LEFT}' y1='{y(share):.1f}' x2='{RIGHT}' y2='{y(share):.1f}' stroke='#eee'/>")
        out.append(_text(LEFT - 6, y(share) + 3.5, f"{share:.0%}", anchor="end", cls="ytick"))
    items = []
    for path in _paths([p for p, counts in t.histogram.items() if counts and counts[-1]]):
        counts = t.histogram.get(path, [])
        total = counts[-1] if counts else 0
        color = COLORS.get(path, "#000")
        items.append(_Item(f"{PATH_LABELS.get(path, path)} (n={total})", color))
        if not total:
            continue
        points = " ".join(f"{x(edge):.1f},{y(n / total):.1f}" for edge, n in zip(HISTOGRAM_EDGES_MS, counts[:-1],
                                                                                 strict=True))
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{points}'/>")
    if not any(counts and counts[-1] for counts in t.histogram.values()):
        out.append(_text((LEFT + RIGHT) / 2, y(0.5), "no actions in the window", anchor="middle", fill="#777"))
    legend, end = _legend(items, bottom + 26)
    return (f"<svg width='{W}' height='{end + 8:.0f}' role='img' aria-label='latency CDF' class='chart cdf'>"
            + "".join(out) + legend + "</svg>")


def _nice_ticks(peak: float) -> list[int]:
    """At least three round ticks from 0 to at least ``peak`` (1, 2 or 5 times a power of ten apart)."""
    peak = max(peak, 1.0)
    unit = 10 ** max(math.floor(math.log10(peak)) - 1, 0)
    step = next(s for s in (m * unit * 10 ** k for k in range(3) for m in (1, 2, 5)) if peak / s <= 5)
    return [i * step for i in range(max(math.ceil(peak / step), 2) + 1)]


def _flag_label(n: int, change: FlagChange, numbers_only: bool) -> str:
    if numbers_only:
        return str(n)
    percent = f" {change.new_percent:g}%" if change.new_percent is not None else ""
    how = f" ({change.action})" if change.action != "set" else ""
    return f"{n} {change.new_phase}{percent}{how}"


def _place(spans: Sequence[tuple[float, float]], max_rows: int) -> list[int | None]:
    """Each span (left, right) into the first row where it overlaps nothing; None past ``max_rows``."""
    rows: list[list[tuple[float, float]]] = []
    out: list[int | None] = []
    for left, right in spans:
        for i, row in enumerate(rows):
            if all(right + GAP <= a or left >= b + GAP for a, b in row):
                row.append((left, right))
                out.append(i)
                break
        else:
            if len(rows) < max_rows:
                rows.append([(left, right)])
                out.append(len(rows) - 1)
            else:
                out.append(None)
    return out


def _label_layout(positions: Sequence[float], changes: Sequence[FlagChange]
                  ) -> tuple[list[tuple[str, float, str, int | None]], int]:
    """For each flag change: its label, x, anchor and row (None: unlabelled); and the rows used."""
    for numbers_only, max_rows in ((False, MAX_LABEL_ROWS), (True, MAX_NUMBER_ROWS)):
        labels, spans, anchors, xs = [], [], [], []
        for n, (pos, change) in enumerate(zip(positions, changes, strict=True), start=1):
            label = _flag_label(n, change, numbers_only)
            width = _width(label, SMALL)
            if pos + 3 + width <= W - 4:
                spans.append((pos + 3, pos + 3 + width))
                anchors.append("start")
                xs.append(pos + 3)
            else:
                spans.append((pos - 3 - width, pos - 3))
                anchors.append("end")
                xs.append(pos - 3)
            labels.append(label)
        rows = _place(spans, max_rows)
        if numbers_only or None not in rows:
            used = max((r for r in rows if r is not None), default=-1) + 1
            return list(zip(labels, xs, anchors, rows, strict=True)), used
    raise AssertionError("unreachable")


def _timeline_svg(report: Report, t: TypeReport, changes: Sequence[FlagChange]) -> str:
    """Actions (dispatches, and shadow decisions) per time bucket by path, the flag changes marked and numbered."""
    span = max((report.until - report.since).total_seconds(), 1e-9)
    since = as_utc(report.since) or report.since

    def x_of(i: float) -> float:
        return LEFT + i / TIMELINE_BUCKETS * (RIGHT - LEFT)

    positions = []
    for change in changes:
        at = as_utc(change.changed_at) or since
        share = min(max((at - since).total_seconds() / span, 0.0), 1.0)
        positions.append(x_of(share * TIMELINE_BUCKETS))
    layout, rows = _label_layout(positions, changes)
    labels_top = 30.0
    top = labels_top + rows * ROW + (8 if rows else 4)
    bottom = top + 150.0
    peak = max([max(series) for series in t.timeline.values() if series] + [0])
    ticks = _nice_ticks(peak)

    def y_of(n: float) -> float:
        return bottom - n / ticks[-1] * (bottom - top)

    out = [_text(8, 18, f"actions per {_duration(span / TIMELINE_BUCKETS)} by path; flag changes numbered",
                 size=TITLE, cls="title")]
    for tick in ticks:
        out.append(f"<line x1='{LEFT}' y1='{y_of(tick):.1f}' x2='{RIGHT}' y2='{y_of(tick):.1f}' stroke='#eee'/>")
        out.append(_text(LEFT - 6, y_of(tick) + 3.5, f"{tick:g}", anchor="end", cls="ytick"))
    out.append(f"<line x1='{LEFT}' y1='{bottom}' x2='{RIGHT}' y2='{bottom}' stroke='#999'/>")
    out.append(_text(LEFT, bottom + 16, _clock(report.since, span), cls="xtick"))
    middle = report.since + (report.until - report.since) / 2
    out.append(_text((LEFT + RIGHT) / 2, bottom + 16, _clock(middle, span), anchor="middle", cls="xtick"))
    out.append(_text(RIGHT, bottom + 16, _clock(report.until, span), anchor="end", cls="xtick"))
    present = [p for p, series in t.timeline.items() if any(series)]
    items = []
    for path in _paths(present):
        color = COLORS.get(path, "#000")
        items.append(_Item(PATH_LABELS.get(path, path), color))
        series = t.timeline.get(path)
        if not series:
            continue
        points = " ".join(f"{x_of(i + 0.5):.1f},{y_of(n):.1f}" for i, n in enumerate(series))
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{points}'/>")
    for pos, (_label, _x, _anchor, row) in zip(positions, layout, strict=True):
        y_from = labels_top + (row + 1) * ROW - 10 if row is not None else top
        out.append(f"<line x1='{pos:.1f}' y1='{y_from:.1f}' x2='{pos:.1f}' y2='{bottom}' stroke='{MARKER}' "
                   "stroke-dasharray='4 3'/>")
    for label, x, anchor, row in layout:  # after the lines, with a halo: a line never crosses a label
        if row is not None:
            out.append(_text(x, labels_top + (row + 1) * ROW - 3, label, size=SMALL, anchor=anchor,
                             cls="flag", halo=True))
    items.append(_Item("flag change (numbered, listed below)" if changes else "flag change (none in the window)",
                       MARKER, dashed=True))
    legend, end = _legend(items, bottom + 26)
    return (f"<svg width='{W}' height='{end + 8:.0f}' role='img' aria-label='actions over time' "
            "class='chart timeline'>" + "".join(out) + legend + "</svg>")


def _changes_list(changes: Sequence[FlagChange]) -> str:
    items = []
    for c in changes:
        old = f"{c.old_phase}{f' {c.old_percent:g}%' if c.old_percent is not None else ''}"
        new = f"{c.new_phase}{f' {c.new_percent:g}%' if c.new_percent is not None else ''}"
        how = c.action + ("; forced" if c.forced else "")
        items.append(f"<li>{escape(_ts(c.changed_at))}: {escape(old)} → {escape(new)} by {escape(c.actor)} "
                     f"({escape(how)}): {escape(c.reason)}</li>")
    return f"<ol class='changes'>{''.join(items)}</ol>"


# --- times ------------------------------------------------------------------------------------------------
def _ts(value: datetime) -> str:
    """To the second, in UTC: ``2026-11-29 14:00:05 UTC``."""
    return f"{(as_utc(value) or value).astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def _clock(value: datetime, span: float) -> str:
    moment = (as_utc(value) or value).astimezone(UTC)
    return f"{moment:%m-%d %H:%M}" if span >= 86_400 else f"{moment:%H:%M:%S}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86_400:.3g} d"


def _mismatch_table(report: Report) -> str:
    if not report.mismatches:
        return "<h2>Mismatches</h2><p>None.</p>"
    rows = "".join(f"<tr><td class='l'>{escape(m.task_id)}</td><td class='l'>{escape(m.workflow_type)}</td>"
                   f"<td class='l'>{escape(m.kind)}</td><td class='l'>{escape(m.detail)}</td></tr>"
                   for m in report.mismatches)
    more = "<p><small>More mismatches exist; see the JSON output.</small></p>" if report.mismatches_truncated else ""
    return (f"<h2>Mismatches ({len(report.mismatches)})</h2><table><tr><th class='l'>task</th><th class='l'>type</th>"
            f"<th class='l'>kind</th><th class='l'>why</th></tr>{rows}</table>{more}")
