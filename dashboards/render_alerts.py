"""Print ``alerts.yml`` with absolute runbook links, ready to copy into Prometheus.

Every ``runbook_url`` in ``dashboards/alerts.yml`` starts with the placeholder ``${RUNBOOK_BASE_URL}``: the rules
cannot know where your copy of the runbooks is browsable. Render them once with that address::

    python dashboards/render_alerts.py --runbook-base-url https://github.com/acme/pollbridge/blob/v1.4.0 \\
        > /etc/prometheus/rules/pollbridge.yml

The base URL is what ``/runbooks/06-incidents.md`` is appended to (a repository's web address for a commit, tag
or branch; an internal wiki that mirrors ``runbooks/``). ``--runbook-base-url`` defaults to the environment
variable ``RUNBOOK_BASE_URL``; the same variable with ``envsubst '$RUNBOOK_BASE_URL'`` renders the file alike,
without the check that the address is absolute. Exit 0; 2 when the address is missing or not an absolute
http(s) URL.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
PLACEHOLDER = "${RUNBOOK_BASE_URL}"
ENV = "RUNBOOK_BASE_URL"


class RenderError(ValueError):
    """The base URL cannot make absolute links."""


def base_url(value: str) -> str:
    """``value`` checked (an absolute http or https URL) and without a trailing slash."""
    value = value.strip()
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RenderError(f"the runbook base URL must be an absolute http(s) URL, got {value!r}")
    if parts.query or parts.fragment:
        raise RenderError(f"the runbook base URL must have no query or fragment, got {value!r}")
    if any(c in value for c in '"\\') or any(c.isspace() or not c.isprintable() for c in value):
        raise RenderError(f"the runbook base URL must not contain quotes, backslashes or spaces, got {value!r}")
    return value.rstrip("/")


def render(text: str, base: str) -> str:
    """``text`` (the rules) with every ``runbook_url`` placeholder replaced by ``base`` (see :func:`base_url`)."""
    lines = []
    for line in text.splitlines(keepends=True):
        if line.strip().startswith("runbook_url:"):
            line = line.replace(PLACEHOLDER, base_url(base))
        lines.append(line)
    rendered = "".join(lines)
    head = f"# Rendered by dashboards/render_alerts.py: runbook links under {base_url(base)}\n"
    return head + rendered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runbook-base-url", default=os.environ.get(ENV),
                        help=f"where runbooks/ is browsable (default: ${ENV})")
    parser.add_argument("--rules", type=Path, default=HERE / "alerts.yml", help="the rules (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.runbook_base_url:
        print(f"render_alerts: error: --runbook-base-url (or {ENV}) is required", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render(args.rules.read_text(encoding="utf-8"), args.runbook_base_url))
    except RenderError as exc:
        print(f"render_alerts: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
