"""deploy/rayservice.yaml, as far as it can be checked without a Kubernetes cluster: its serveConfigV2 against Ray
Serve's own schema, the application built from it (the builder and its flags), and the image and Ray version."""
from __future__ import annotations

import re

import pytest
import yaml

from conftest import ROOT

pytest.importorskip("ray.serve", reason="Ray is not installed: pip install -r requirements-ray.txt")


def test_the_rayservice_manifest_passes_rays_schema_and_builds_the_app():
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema
    from ray._common.utils import import_attr

    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    [app] = serve_config.applications
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    ingress = built._bound_deployment
    replicas = ingress._replica_config.init_args[0]._bound_deployment  # the ingress's first argument
    assert (ingress.name, replicas.name) == ("TernIngress", "TernReplica")
    autoscaling = replicas._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (2, 8, 8)
    assert replicas.ray_actor_options["num_cpus"] == 2

    cluster = manifest["spec"]["rayClusterConfig"]
    pinned = re.search(r"ray\[serve\]==([\d.]+)", (ROOT / "requirements-ray.txt").read_text()).group(1)
    assert cluster["rayVersion"] == pinned
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]} == {"tern-ray:latest"}
    assert "requirements-ray.txt" in (ROOT / "deploy" / "Dockerfile.ray").read_text()
