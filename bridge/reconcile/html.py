"""The reconcile report as one self-contained HTML file: no script, no external asset, inline SVG charts.

Per workflow type: the counts and verdict table, the latency CDF of both paths (log scale), and the
dispatches over the window by path with the flag changes drawn on the timeline; then the mismatches
with their explanation. Every text that comes from the database is escaped.
"""

from __future__ import annotations

import math
from datetime import datetime
from html import escape

from bridge.reconcile.report import HISTOGRAM_EDGES_MS, TIMELINE_BUCKETS, Report, TypeReport

COLORS = {"poller": "#d9822b", "events": "#2b7bd9", "fallback": "#c23030", "decision": "#6b6b6b"}
W, H, PAD = 560, 220, 40

CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.pass{color:#1a7f37;font-weight:bold}
.fail{color:#c23030;font-weight:bold}.charts{display:flex;flex-wrap:wrap;gap:1em}
svg{background:#fafafa;border:1px solid #ddd}small{color:#666}
"""


def render_html(report: Report) -> str:
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>pollbridge reconcile {escape(report.since.isoformat())} - {escape(report.until.isoformat())}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>pollbridge reconcile{' (control: the poller against itself)' if report.control else ''}</h1>",
        f"<p>Window {escape(report.since.isoformat())} to {escape(report.until.isoformat())}. Verdict: "
        f"<span class='{report.verdict}'>{report.verdict.upper()}</span></p>",
        _summary_table(report),
    ]
    for t in report.types:
        parts.append(f"<h2>{escape(t.workflow_type)} <small>phase {escape(t.phase)}</small></h2>")
        if t.criteria:
            parts.append("<ul>" + "".join(
                f"<li class='{'pass' if c.passed else 'fail'}'>{escape(c.name)}: {escape(c.detail)}</li>"
                for c in t.criteria) + "</ul>")
        parts.append("<div class='charts'>" + _cdf_svg(t) + _timeline_svg(report, t) + "</div>")
    parts.append(_mismatch_table(report))
    parts.append("</body></html>")
    return "\n".join(parts)


def _summary_table(report: Report) -> str:
    head = ("<tr><th class='l'>type</th><th class='l'>phase</th><th>tasks</th><th>compared</th><th>matched</th>"
            "<th>missing</th><th>extra</th><th>duplicate</th><th>early</th><th>late</th><th>pending</th>"
            "<th>poller p50/p99 ms</th><th>events p50/p99 ms</th><th>miss upper 95%</th><th>verdict</th></tr>")
    rows = []
    for t in report.types:
        c = t.counts
        rows.append(
            f"<tr><td class='l'>{escape(t.workflow_type)}</td><td class='l'>{escape(t.phase)}</td>"
            f"<td>{sum(c.values())}</td><td>{t.compared}</td>"
            + "".join(f"<td>{c.get(k, 0)}</td>" for k in ("matched", "missing", "extra", "duplicate", "early",
                                                          "late", "pending"))
            + f"<td>{_p(t, 'poller')}</td><td>{_p(t, 'events')}</td><td>{t.miss_rate_upper:.4%}</td>"
            f"<td class='{t.verdict}'>{t.verdict}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _p(t: TypeReport, path: str) -> str:
    stats = t.latency_ms.get(path)
    if not stats:
        return "-"
    return f"{stats['p50']:.1f} / {stats['p99']:.1f}"


def _cdf_svg(t: TypeReport) -> str:
    """Cumulative share of tasks acted on within x ms, per path, x on a log scale."""
    lo, hi = math.log10(HISTOGRAM_EDGES_MS[0]), math.log10(HISTOGRAM_EDGES_MS[-1])

    def x(ms: float) -> float:
        return PAD + (math.log10(ms) - lo) / (hi - lo) * (W - 2 * PAD)

    def y(share: float) -> float:
        return H - PAD + 10 - share * (H - 2 * PAD)

    out = [f"<svg width='{W}' height='{H}' role='img' aria-label='latency CDF'>",
           f"<text x='{PAD}' y='14' font-size='12'>ready -> action latency (CDF, log ms)</text>"]
    for edge in (1, 10, 100, 1_000, 10_000, 100_000):
        out.append(f"<line x1='{x(edge):.1f}' y1='{y(0):.1f}' x2='{x(edge):.1f}' y2='{y(1):.1f}' stroke='#e3e3e3'/>"
                   f"<text x='{x(edge):.1f}' y='{H - 8}' font-size='10' text-anchor='middle'>"
                   f"{edge if edge < 1000 else str(edge // 1000) + 's'}</text>")
    for share in (0.5, 0.9, 0.99):
        out.append(f"<line x1='{PAD}' y1='{y(share):.1f}' x2='{W - PAD}' y2='{y(share):.1f}' stroke='#eee'/>"
                   f"<text x='4' y='{y(share) + 3:.1f}' font-size='10'>{share:g}</text>")
    legend_y = 28
    for path, counts in sorted(t.histogram.items()):
        total = counts[-1] if counts else 0
        if not total:
            continue
        points = " ".join(f"{x(edge):.1f},{y(n / total):.1f}" for edge, n in zip(HISTOGRAM_EDGES_MS, counts[:-1],
                                                                                 strict=True))
        color = COLORS.get(path, "#000")
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{points}'/>")
        out.append(f"<text x='{W - PAD - 90}' y='{legend_y}' font-size='11' fill='{color}'>{escape(path)} "
                   f"(n={total})</text>")
        legend_y += 14
    out.append("</svg>")
    return "".join(out)


def _timeline_svg(report: Report, t: TypeReport) -> str:
    """Dispatches (and shadow decisions) per time bucket by path, with the flag changes as markers."""
    span = max((report.until - report.since).total_seconds(), 1e-9)
    peak = max([max(series) for series in t.timeline.values() if series] + [1])

    def x_of(i: float) -> float:
        return PAD + i / TIMELINE_BUCKETS * (W - 2 * PAD)

    def y_of(n: float) -> float:
        return H - PAD - n / peak * (H - 2 * PAD - 10)

    out = [f"<svg width='{W}' height='{H}' role='img' aria-label='dispatches over time'>",
           f"<text x='{PAD}' y='14' font-size='12'>actions per {span / TIMELINE_BUCKETS:.3g} s, flag changes "
           "marked</text>",
           f"<line x1='{PAD}' y1='{H - PAD}' x2='{W - PAD}' y2='{H - PAD}' stroke='#999'/>",
           f"<text x='{PAD}' y='{H - 8}' font-size='10'>{escape(_hm(report.since))}</text>",
           f"<text x='{W - PAD}' y='{H - 8}' font-size='10' text-anchor='end'>{escape(_hm(report.until))}</text>",
           f"<text x='4' y='{y_of(peak) + 3:.1f}' font-size='10'>{peak}</text>"]
    for path, series in sorted(t.timeline.items()):
        color = COLORS.get(path, "#000")
        points = " ".join(f"{x_of(i + 0.5):.1f},{y_of(n):.1f}" for i, n in enumerate(series))
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{points}'/>")
    for change in report.flag_changes:
        if change.workflow_type != t.workflow_type:
            continue
        at = change.changed_at if change.changed_at.tzinfo else change.changed_at.replace(tzinfo=report.since.tzinfo)
        pos = x_of((at - report.since).total_seconds() / span * TIMELINE_BUCKETS)
        out.append(f"<line x1='{pos:.1f}' y1='{PAD - 10}' x2='{pos:.1f}' y2='{H - PAD}' stroke='#555' "
                   f"stroke-dasharray='4 3'/><text x='{pos + 3:.1f}' y='{PAD - 2}' font-size='10'>"
                   f"{escape(change.new_phase)}{' (' + escape(change.actor) + ')' if change.action != 'set' else ''}"
                   "</text>")
    out.append("</svg>")
    return "".join(out)


def _hm(value: datetime) -> str:
    return value.strftime("%H:%M:%S")


def _mismatch_table(report: Report) -> str:
    if not report.mismatches:
        return "<h2>Mismatches</h2><p>None.</p>"
    rows = "".join(f"<tr><td class='l'>{escape(m.task_id)}</td><td class='l'>{escape(m.workflow_type)}</td>"
                   f"<td class='l'>{escape(m.kind)}</td><td class='l'>{escape(m.detail)}</td></tr>"
                   for m in report.mismatches)
    more = "<p><small>More mismatches exist; see the JSON output.</small></p>" if report.mismatches_truncated else ""
    return (f"<h2>Mismatches ({len(report.mismatches)})</h2><table><tr><th class='l'>task</th><th class='l'>type</th>"
            f"<th class='l'>kind</th><th class='l'>why</th></tr>{rows}</table>{more}")
