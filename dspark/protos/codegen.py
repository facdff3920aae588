"""Regenerate the committed gRPC stubs from `protos/dspark/v1/dspark.proto`.

    python -m dspark.protos.codegen          # rewrite dspark/protos/dspark_pb2*.py(i)

Needs grpcio-tools at the version pinned in pyproject.toml's test extra: the generated files name
the versions that made them, so another version gives other files (and the check test fails).
The proto directory is mapped to the virtual path `dspark/protos`, so the generated modules
import each other as `dspark.protos.*` without any rewriting of generated code.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = _REPO / "protos" / "dspark" / "v1"
PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED = ("dspark_pb2.py", "dspark_pb2.pyi", "dspark_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under `out_root/dspark/protos/`; returns the generated files."""
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-Idspark/protos={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO_DIR / "dspark.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / "dspark" / "protos" / name for name in GENERATED]


def main() -> int:
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, PACKAGE_DIR / path.name)
            print(PACKAGE_DIR / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
