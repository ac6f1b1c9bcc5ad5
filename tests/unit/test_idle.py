"""The idle back-off of the pollers without a cross-process wake-up (embedded bus, relay on SQLite)."""

from __future__ import annotations

import pytest

from bridge.core.idle import MAX_IDLE_POLL, idle_poll


def test_busy_pollers_keep_their_interval() -> None:
    assert idle_poll(0.01, 0.0) == 0.01
    assert idle_poll(0.01, 0.05) == 0.01  # a tenth of 50 ms is below the base


def test_idle_pollers_slow_down_to_the_cap() -> None:
    assert idle_poll(0.01, 0.5) == pytest.approx(0.05)
    assert idle_poll(0.01, 60.0) == MAX_IDLE_POLL
    assert idle_poll(0.3, 60.0) == 0.3  # never faster than asked
