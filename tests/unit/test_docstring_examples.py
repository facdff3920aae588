"""Every `>>>` example in the package's docstrings runs and prints what it says.

The examples are documentation users copy; a changed signature or result must fail here, not
in a user's session. Examples that need a cluster or a running server say `# doctest: +SKIP`.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import dspark

# Top-level folders that pyproject's package-dir maps into the `dspark` namespace.
MAPPED = ("coordinator", "draft_worker", "target_worker", "kernels")
PACKAGES = {
    "dspark": Path(dspark.__file__).resolve().parent,
    **{f"dspark.{name}": Path(importlib.import_module(f"dspark.{name}").__file__).parent
       for name in MAPPED},
}


def _modules_with_examples() -> list[str]:
    names = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if "protos" in rel.parts or (package == "dspark" and rel.parts[0] in MAPPED):
                continue  # generated stubs; the mapped folders are walked on their own
            if ">>> " in path.read_text(encoding="utf-8"):
                parts = [*rel.with_suffix("").parts]
                if parts[-1] == "__init__":
                    parts.pop()
                names.append(".".join([package, *parts]))
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found() -> None:
    # The walk itself could silently find nothing; these modules are known to hold examples.
    assert {"dspark.kernels.acceptance", "dspark.coordinator.engine", "dspark"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    examples = [ex for t in doctest.DocTestFinder().find(module) for ex in t.examples]
    if all(ex.options.get(doctest.SKIP) for ex in examples):
        pytest.skip(f"{name}: its {len(examples)} examples need a Ray cluster or a server")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
