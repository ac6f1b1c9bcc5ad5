"""Flags per workflow type: the store (phases with an audit trail) and the router every process reads."""

from __future__ import annotations
