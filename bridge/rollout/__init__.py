"""Moving a workflow type between phases: promotion gated by the reconciler, the guardian that demotes,
and the checks shared by ``preflight`` and ``doctor``.
"""

from __future__ import annotations
