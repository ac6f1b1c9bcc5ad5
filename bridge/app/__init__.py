"""The composition root: components wired from settings, ``init``/``uninstall``, ``run-all`` and ``demo``."""

from __future__ import annotations
