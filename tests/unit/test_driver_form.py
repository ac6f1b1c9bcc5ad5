"""The driver path's one-time conversion of SQLAlchemy's ``pyformat`` text to psycopg's server form."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from bridge.db.driver import server_form

_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
# No digits: "$1" followed by "0" reads as "$10" (so it does in psycopg's own conversion; SQLAlchemy never
# renders a digit right after a placeholder).
_sql = st.text(st.characters(blacklist_characters="%$", blacklist_categories=("Cs", "Nd")), max_size=20)


@given(st.lists(st.tuples(_sql, st.one_of(_names, st.just("%"))), max_size=12), _sql)
def test_placeholders_are_numbered_in_order_and_percent_signs_unescaped(parts: list[tuple[str, str]],
                                                                        tail: str) -> None:
    pyformat = "".join(text + ("%%" if token == "%" else f"%({token})s") for text, token in parts) + tail
    form = server_form(pyformat)
    assert form is not None
    converted, order = form
    names = [token for _, token in parts if token != "%"]
    assert list(order) == list(dict.fromkeys(names))  # first use numbers a name; a name used again reuses it
    # Back to pyformat: the same text, so nothing but the placeholders and the escapes changed.
    back = re.sub(r"\$(\d+)", lambda m: f"%({order[int(m.group(1)) - 1]})s", converted.replace("%", "%%"))
    assert back == pyformat


def test_a_lone_percent_sign_keeps_psycopgs_own_conversion() -> None:
    assert server_form("SELECT 1 % 2") is None
    assert server_form("SELECT %s") is None
    assert server_form("SELECT %(a)s + %(a)s, '5%%'") == ("SELECT $1 + $1, '5%'", ("a",))
