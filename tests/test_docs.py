"""The README's config reference and command list stay in step with the code."""

from __future__ import annotations

from disttrain.config import RunConfig
from helpers import REPO


def test_readme_documents_every_config_key():
    readme = (REPO / "README.md").read_text()
    missing = []
    for section, field in RunConfig.model_fields.items():
        assert f"`{section}`" in readme or f"`{section}." in readme, section
        for name, info in getattr(field.annotation, "model_fields", {}).items():
            key = info.alias or name
            if f"`{key}`" not in readme and f"`{section}.{key}`" not in readme:
                missing.append(f"{section}.{key}")
    assert not missing, f"README config reference lacks: {missing}"


def test_readme_starts_with_the_two_commands():
    head = (REPO / "README.md").read_text()[:600]
    assert "make demo" in head and "make test" in head


def test_ci_runs_make_test():
    assert "make test" in (REPO / ".ci" / "run").read_text()
