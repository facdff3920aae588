"""The demo training text: the Python standard library's own source files.

Every machine with Python has them. Files are split into train and held-out sets by a hash of
their relative path (about 1 in 20 held out), so the split is the same on every machine.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

SEPARATOR = "<|endoftext|>"
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not (set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS)
    ]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_held_out(path: Path) -> bool:
    rel = str(path.relative_to(Path(sysconfig.get_paths()["stdlib"])))
    return zlib.crc32(rel.encode()) % 20 == 0


def read_texts(held_out: bool) -> list[str]:
    """Source texts of the train (False) or held-out (True) files, in a fixed order."""
    out = []
    for p in stdlib_files():
        if is_held_out(p) == held_out:
            try:
                out.append(p.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
    return out
