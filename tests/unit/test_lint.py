"""The code passes the project's own lint configuration (pyproject.toml's `[tool.ruff]`:
pycodestyle, pyflakes, isort, pyupgrade and bugbear at 100 columns), so STYLE.md's "ruff" is
checked by the suite and not only by whoever remembers to run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes() -> None:
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
