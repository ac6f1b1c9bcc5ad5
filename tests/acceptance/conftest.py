from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import Run


@pytest.fixture
def pollbridge(tmp_path: Path) -> Run:
    """Run the installed ``pollbridge`` console script in an empty folder, as a user would."""
    exe = shutil.which("pollbridge")
    if exe is None:
        pytest.fail("the `pollbridge` console script is not installed: run `pip install .` first", pytrace=False)

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 180, cwd: Path | None = None,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("POLLBRIDGE_")}
        full_env.update(env or {})
        return subprocess.run([exe, *args], cwd=cwd or tmp_path, env=full_env, capture_output=True, text=True,
                              timeout=timeout, input=input)

    return run
