"""Every Kubernetes manifest in examples/ against the API models of Kubernetes, JobSet and Kubeflow Trainer (the
`kubeflow-trainer-api` package's, generated from the projects' OpenAPI specs; offline), strictly: a field the API does
not have, a misspelt or renamed one, fails here as it would fail `kubectl apply`. And what the examples promise
each other: the TrainJob's runtime exists, the grace period leaves the emergency checkpoint its shutdown timeout."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from helpers import REPO

import kubeflow_trainer_api.models as models  # noqa: E402  (in the test install: a missing package fails, not skips)

MODELS = {
    ("v1", "Service"): "IoK8sApiCoreV1Service",
    ("batch/v1", "Job"): "IoK8sApiBatchV1Job",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "JobsetV1alpha2JobSet",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "TrainerV1alpha1TrainJob",
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "TrainerV1alpha1TrainingRuntime",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "TrainerV1alpha1ClusterTrainingRuntime",
}


def manifests() -> list[tuple[str, dict]]:
    """(file:document, manifest) for every YAML document under examples/ that has an apiVersion and a kind."""
    found = []
    for path in sorted((REPO / "examples").rglob("*.y*ml")):
        for n, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
                found.append((f"{path.relative_to(REPO)}:{n}", doc))
    return found


def _models_in(annotation) -> list[type]:
    """The model classes an annotation (Optional[List[Model]], Dict[str, Model], ...) holds."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _is_one_of(model: type) -> bool:
    """A oneOf wrapper (Quantity, IntOrString): its value is a plain string or number."""
    return "actual_instance" in model.model_fields


def strict_problems(value, model: type, where: str) -> list[str]:
    """Every key of `value` that `model` (recursively) does not have, as `where.key: unknown field (allowed: ...)`."""
    if _is_one_of(model):
        return [] if isinstance(value, (str, int, float)) else [f"{where}: {value!r} is not a string or a number"]
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping for {model.__name__}, got {type(value).__name__}"]
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    problems = []
    for key, item in value.items():
        if key not in fields:
            problems.append(f"{where}.{key}: unknown field (allowed: {', '.join(sorted(fields))})")
            continue
        annotation = fields[key].annotation
        inner = _models_in(annotation)
        if not inner or item is None:
            continue
        if isinstance(item, list):
            elements = [(f"{where}.{key}[{i}]", e) for i, e in enumerate(item)]
        elif isinstance(item, dict) and _dict_of_models(annotation):
            elements = [(f"{where}.{key}.{k}", e) for k, e in item.items()]
        else:
            elements = [(f"{where}.{key}", item)]
        for at, element in elements:
            problems += strict_problems(element, inner[0], at)
    return problems


def _dict_of_models(annotation) -> bool:
    """Dict[str, Model] (possibly inside Optional)."""
    if typing.get_origin(annotation) is dict:
        return True
    return any(_dict_of_models(a) for a in typing.get_args(annotation) if typing.get_origin(a) is not None)


def problems_of(manifest: dict) -> list[str]:
    name = MODELS.get((manifest["apiVersion"], manifest["kind"]))
    if name is None:
        return [f"{manifest['apiVersion']} {manifest['kind']}: no API model known to this test (add one to MODELS)"]
    model = getattr(models, name)
    problems = strict_problems(manifest, model, manifest["kind"])
    try:
        model.from_dict(manifest)  # the models' own types: strict ints, strings, required fields
    except Exception as exc:
        problems.append(f"{manifest['kind']}: {str(exc).splitlines()[0]} ({str(exc).splitlines()[1:3]})")
    return problems


ALL = manifests()


def test_the_examples_hold_every_kind_of_manifest():
    kinds = {doc["kind"] for _, doc in ALL}
    assert {"Job", "Service", "TrainJob", "ClusterTrainingRuntime"} <= kinds, kinds


@pytest.mark.parametrize("where, manifest", ALL, ids=[w for w, _ in ALL])
def test_manifest_matches_the_api(where, manifest):
    assert problems_of(manifest) == []


def test_a_renamed_field_fails():
    """The check is not vacuous: a field renamed deep in a pod template, or a wrong type, is named."""
    where, runtime = next((w, d) for w, d in ALL if d["kind"] == "ClusterTrainingRuntime")
    text = yaml.safe_dump(runtime)
    renamed = yaml.safe_load(text.replace("terminationGracePeriodSeconds", "terminationGracePeriod"))
    assert problems_of(renamed) == [
        "ClusterTrainingRuntime.spec.template.spec.replicatedJobs[0].template.spec.template.spec."
        f"terminationGracePeriod: unknown field (allowed: {_pod_spec_fields()})"]
    job = next(d for _, d in ALL if d["kind"] == "TrainJob")
    wrong = yaml.safe_load(yaml.safe_dump(job).replace("numNodes: 2", "numNodes: two"))
    assert any("num_nodes" in p or "numNodes" in p for p in problems_of(wrong)), problems_of(wrong)


def _pod_spec_fields() -> str:
    model = models.IoK8sApiCoreV1PodSpec
    return ", ".join(sorted(f.alias or n for n, f in model.model_fields.items()))


def _shutdown_timeouts(manifest: dict) -> list[int]:
    return [int(m) for m in re.findall(r"--shutdown-timeout[= ](\d+)", yaml.safe_dump(manifest))]


def _grace_periods(manifest: dict) -> list[int]:
    return [int(m) for m in re.findall(r"terminationGracePeriodSeconds: (\d+)", yaml.safe_dump(manifest))]


def test_the_trainjob_names_a_runtime_of_the_examples_and_its_grace_period_covers_the_save():
    runtimes = {d["metadata"]["name"]: d for _, d in ALL if d["kind"] == "ClusterTrainingRuntime"}
    for where, job in ((w, d) for w, d in ALL if d["kind"] == "TrainJob"):
        ref = job["spec"]["runtimeRef"]
        assert ref["kind"] == "ClusterTrainingRuntime" and ref["name"] in runtimes, where
        runtime = runtimes[ref["name"]]
        assert "torch" in runtime["spec"]["mlPolicy"]  # torchrun's settings injected into the pods
        (grace,), (timeout,) = _grace_periods(runtime), _shutdown_timeouts(job)
        assert timeout < grace, f"{where}: --shutdown-timeout {timeout} s must stay below the grace period {grace} s"
    for where, job in ((w, d) for w, d in ALL if d["kind"] == "Job"):
        (grace,), (timeout,) = _grace_periods(job), _shutdown_timeouts(job)
        assert timeout < grace, where


def test_every_reference_to_a_manifest_exists():
    """The docs and the manifests' own comments name files that exist."""
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*")]
    texts = [p.read_text() for p in files if p.is_file() and p.suffix in (".md", ".yaml", ".yml", ".sbatch")]
    named = {m for t in texts for m in re.findall(r"examples/kubernetes[\w/.-]*\.ya?ml", t)}
    assert named and all((REPO / n).is_file() for n in named), sorted(n for n in named if not (REPO / n).is_file())
