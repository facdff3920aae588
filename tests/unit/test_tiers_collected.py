"""The suite as CI collects it (from the root, `testpaths`) holds every tier. pytest skips
folders named `dist` by default, and so collected no distributed test until pyproject.toml
said otherwise (`norecursedirs`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_tier_is_collected_from_the_root() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    tiers = {line.split("/")[1] for line in out.splitlines() if line.startswith("tests/")}
    assert tiers == {"unit", "dist", "e2e"}, tiers
