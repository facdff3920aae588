"""The cluster launch files: the `ray up` file against the schema Ray ships, the KubeRay
manifests' structure, the serve command, and that nothing exposes Ray's ports publicly."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def _ray_schema() -> dict:
    import ray

    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_ray_up_file_validates_against_rays_schema() -> None:
    config = yaml.safe_load((CLUSTER / "ray-up.yaml").read_text())
    jsonschema.validate(config, _ray_schema())
    assert config["head_node_type"] in config["available_node_types"]
    assert any(t["resources"].get("GPU", 0) > 0 for t in config["available_node_types"].values())


def test_schema_check_catches_a_broken_file() -> None:
    config = yaml.safe_load((CLUSTER / "ray-up.yaml").read_text())
    del config["provider"]["type"]
    config["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, _ray_schema())


def test_ray_up_keeps_ray_private() -> None:
    config = yaml.safe_load((CLUSTER / "ray-up.yaml").read_text())
    assert config["provider"]["use_internal_ips"] is True
    for rule in config["provider"]["security_group"]["IpPermissions"]:
        assert all(r["CidrIp"] != "0.0.0.0/0" for r in rule.get("IpRanges", []))
        assert not rule.get("Ipv6Ranges")
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    assert "RAY_AUTH_MODE=token" in " ".join(config["docker"]["run_options"])


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((CLUSTER / "kuberay" / name).read_text()) if d]


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("name,kind", [("raycluster.yaml", "RayCluster"),
                                       ("rayservice.yaml", "RayService")])
def test_kuberay_manifests_have_head_gpu_workers_ports_and_auth(name: str, kind: str) -> None:
    docs = _docs(name)
    ray_doc = next(d for d in docs if d["kind"] == kind)
    assert ray_doc["apiVersion"] == "ray.io/v1"
    spec = _cluster_spec(ray_doc)
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    container = head["template"]["spec"]["containers"][0]
    head_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert head_ports["gcs-server"] == 6379 and head_ports["grpc"] == 50051
    gpu = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert int(gpu["limits"]["nvidia.com/gpu"]) >= 2  # a tp=2 group per pod
    services = [d for d in docs if d["kind"] == "Service"]
    assert services and all(s["spec"]["type"] == "ClusterIP" for s in services)


def test_raycluster_head_runs_the_coordinator_against_the_cluster() -> None:
    ray_doc = next(d for d in _docs("raycluster.yaml") if d["kind"] == "RayCluster")
    head = ray_doc["spec"]["headGroupSpec"]["template"]
    script = " ".join(head["spec"]["containers"][0]["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in script
    assert "dspark serve --address auto" in script and '--host "$POD_IP"' in script
    assert head["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"


def test_rayservice_serves_the_same_command_line() -> None:
    doc = next(d for d in _docs("rayservice.yaml") if d["kind"] == "RayService")
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    app = serve["applications"][0]
    assert app["import_path"].startswith("dspark.")
    assert "--address auto" in app["args"]["serve_args"]


def _serve_command(name: str) -> str:
    """The `dspark serve` arguments each manifest runs the coordinator with."""
    if name == "rayservice.yaml":
        doc = next(d for d in _docs(name) if d["kind"] == "RayService")
        return yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]["serve_args"]
    doc = next(d for d in _docs(name) if d["kind"] == "RayCluster")
    script = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    line = script.replace("\\\n", " ").split("exec dspark serve", 1)[1].splitlines()[0]
    return line.replace('"$POD_IP"', "10.0.0.5")


@pytest.mark.parametrize("name,kind", [("raycluster.yaml", "RayCluster"),
                                       ("rayservice.yaml", "RayService")])
def test_kuberay_grpc_api_asks_for_a_token_from_a_private_secret(name: str, kind: str) -> None:
    from dspark.coordinator.serve_app import parse_serve_args

    cfg = parse_serve_args(_serve_command(name))  # the real `dspark serve` flags
    assert cfg.auth_token_file is not None
    head = _cluster_spec(next(d for d in _docs(name) if d["kind"] == kind))["headGroupSpec"]
    pod = head["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in mounts.values()
                 if cfg.auth_token_file.startswith(m["mountPath"].rstrip("/") + "/"))
    secret = volumes[mount["name"]]["secret"]  # a Secret, never a token in the manifest
    assert mount["readOnly"] is True
    assert secret["secretName"] and secret["defaultMode"] == 0o400  # the server warns otherwise
    assert cfg.auth_token_file.rsplit("/", 1)[1] == "token"  # the key the docs create
