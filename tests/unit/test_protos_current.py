"""The committed gRPC stubs are exactly what the pinned grpcio-tools generates from the proto."""

from __future__ import annotations

from pathlib import Path

from dspark.protos import codegen


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    for generated in codegen.generate(tmp_path):
        committed = codegen.PACKAGE_DIR / generated.name
        assert committed.exists(), f"{committed} missing: run python -m dspark.protos.codegen"
        assert committed.read_bytes() == generated.read_bytes(), (
            f"{committed.name} is stale: run python -m dspark.protos.codegen "
            "(with grpcio-tools as pinned)"
        )


def test_stubs_import_and_name_the_service() -> None:
    from dspark.protos import dspark_pb2, dspark_pb2_grpc

    service = dspark_pb2.DESCRIPTOR.services_by_name["DSpark"]
    assert service.full_name == "dspark.v1.DSpark"
    assert {m.name for m in service.methods} == {"Generate", "GetModelInfo"}
    assert service.methods_by_name["Generate"].server_streaming
    assert hasattr(dspark_pb2_grpc, "DSparkStub")
