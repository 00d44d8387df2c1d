"""The Kubernetes manifests docs/multinode.md shows (issue 48): valid against Kubernetes' own
schemas (``kubernetes-validate``, offline, strict: an unknown or misspelt field fails), and the
command the bare-host section runs. Not run on a cluster here."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
yaml = pytest.importorskip("yaml")

DOC = Path(__file__).resolve().parent.parent / "docs" / "multinode.md"
VERSION = "1.30.0"  # a Kubernetes release the manifests must hold for (indexed Jobs are GA)


def manifests() -> list[dict[str, Any]]:
    """Every YAML document of the doc's Kubernetes section."""
    text = DOC.read_text()
    section = text[text.index("## Kubernetes\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/multinode.md's Kubernetes section shows no manifest"
    return [d for b in blocks for d in yaml.safe_load_all(b) if d is not None]


def test_the_docs_manifests_are_valid_kubernetes_objects() -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} == {"Service", "Job"}
    for d in docs:
        kv.validate(d, VERSION, strict=True)  # raises ValidationError, naming the field


def test_the_job_runs_ciuic_run_around_torchrun_with_a_stable_rendezvous_name() -> None:
    docs = {d["kind"]: d for d in manifests()}
    job, service = docs["Job"], docs["Service"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert pod["terminationGracePeriodSeconds"] >= 60  # the emergency snapshot's time
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:2] == ["ciuic", "run"] and "torchrun" in command
    endpoint = command[command.index("--rdzv-endpoint") + 1]
    name = job["metadata"]["name"]
    assert endpoint == f"{name}-0.{name}:{service['spec']['ports'][0]['port']}"
    assert command[command.index("--nnodes") + 1] == str(spec["completions"])
    assert "memory" in container["resources"]["limits"]  # room for --host-memory


def test_a_misspelt_field_fails_the_validation() -> None:
    job = copy.deepcopy(next(d for d in manifests() if d["kind"] == "Job"))
    pod = job["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(kv.ValidationError):
        kv.validate(job, VERSION, strict=True)
