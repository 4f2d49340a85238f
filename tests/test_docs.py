"""The config reference (docs/config.md, generated from the schema), the README's command lines, and
docs/architecture.md's diagrams and module paths stay in step with the code."""

from __future__ import annotations

import argparse
import re
import typing

from pydantic import BaseModel

from disttrain.config.schema import RunConfig
from helpers import REPO

SRC = REPO / "src" / "disttrain"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def section_of(info) -> type[BaseModel] | None:
    """The section class a field holds (`LoraConfig | None` too), or None for a plain key."""
    for candidate in (info.annotation, *typing.get_args(info.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def schema_keys(section=RunConfig, prefix: str = "") -> dict[str, object]:
    """Every key of the schema, dotted as a config writes it (aliases: `checkpoint.async`), walked from
    RunConfig.model_fields down through every nested section (`model.lora.rank`, `model.moe.num_experts`)."""
    keys = {}
    for name, info in section.model_fields.items():
        key = prefix + (info.alias or name)
        keys[key] = info
        if section_of(info) is not None:
            keys.update(schema_keys(section_of(info), key + "."))
    return keys


def test_every_config_key_has_a_description():
    """A key's description is its row in docs/config.md; a top-level section (`model`, `parallel`, ...) is a
    heading there, described by its class's docstring; a nested one (`model.lora`) has both."""
    keys = schema_keys()
    assert {"engine", "model.lora.rank", "model.moe.capacity_factor", "checkpoint.async", "run.name"} <= set(keys)
    missing = sorted(key for key, info in keys.items()
                     if not (info.description or "").strip() and not ("." not in key and section_of(info)))
    assert not missing, f"config keys without a description (docs/config.md is generated from them): {missing}"
    undocumented = sorted(key for key, info in keys.items()
                          if section_of(info) is not None and not (section_of(info).__doc__ or "").strip())
    assert not undocumented, f"config sections without a docstring: {undocumented}"


def test_the_config_page_is_generated_from_the_schema():
    from disttrain.config import reference

    page = REPO / "docs" / "config.md"
    assert reference.PAGE == page
    assert page.is_file() and page.read_text() == reference.render(), (
        f"docs/config.md is stale: regenerate it with `{reference.COMMAND}`")
    text = page.read_text()
    rows = [key for key, info in schema_keys().items() if "." in key or section_of(info) is None]
    assert [key for key in rows if f"| `{key}` |" not in text] == []
    assert [f"## `{key}`" for key in RunConfig.model_fields if f"## `{key}`\n" not in text] == ["## `engine`"]


def test_the_config_page_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    from disttrain.config import reference

    stale = tmp_path / "docs" / "config.md"
    stale.parent.mkdir()
    monkeypatch.setattr(reference, "PAGE", stale)
    assert reference.main(["--write"]) == 0 and reference.main(["--check"]) == 0
    stale.write_text(stale.read_text().replace("optimizer steps", "steps of the optimizer"))
    capsys.readouterr()
    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"docs/config.md is stale: regenerate it with `{reference.COMMAND}`"]


def test_readme_starts_with_the_two_commands():
    head = (REPO / "README.md").read_text()[:600]
    assert "make demo" in head and "make test" in head


def test_readme_is_short_and_points_to_the_reference_pages():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 10240, "README.md over 10 KB: move the detail to docs/"
    for page in ("docs/config.md", "docs/guide.md", "docs/parallelism.md", "docs/planning.md",
                 "docs/troubleshooting.md", "docs/benchmarks.md", "docs/architecture.md"):
        assert f"]({page}" in readme and (REPO / page).is_file(), page
    named = re.findall(r"`(src/disttrain/[\w/]+\.py)`", readme)
    assert named and [p for p in named if not (REPO / p).is_file()] == []


def test_ci_runs_make_test():
    assert "make test" in (REPO / ".ci" / "run").read_text()


# ------------------------------------------------------------------ README command lines vs the CLI parser
def cli_commands() -> dict[tuple[str, ...], set[str]]:
    """Every command path of the real parser (`()`, `("train",)`, `("bench", "comm")`, ...) -> its long
    options. Built in-process from disttrain.cli.build_parser."""
    from disttrain.cli import build_parser

    commands: dict[tuple[str, ...], set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        commands[path] = {s for s in parser._option_string_actions if s.startswith("--")}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, path + (name,))

    walk(build_parser(), ())
    return commands


def leaf_commands(commands) -> set[tuple[str, ...]]:
    return {p for p in commands if p and not any(q[:len(p)] == p and q != p for q in commands)}


def logical_lines(block: str) -> list[str]:
    """A code block's command lines: `# comments` dropped, `\\` continuations and indented
    continuation lines joined to the line they continue."""
    lines: list[str] = []
    joining = False
    for raw in block.splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).rstrip()
        if not line.strip():
            joining = False
            continue
        continued = line.endswith("\\")
        line = line.rstrip("\\").rstrip()
        if lines and (joining or raw[:1].isspace()):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line.strip())
        joining = continued
    return lines


def readme_lines(text: str) -> list[str]:
    """Every fenced code line (joined as above) and every inline code span outside the fences."""
    lines = [line for _, block in FENCE.findall(text) for line in logical_lines(block)]
    prose = FENCE.sub("", text)
    return lines + [span.strip() for span in re.findall(r"`([^`\n]+)`", prose)]


def command_on(line: str, commands) -> tuple[tuple[str, ...] | None, list[str], list[str]]:
    """(command path, its arguments, problems) of a `disttrain ...` line (`torchrun ... -m disttrain
    train ...` counts as `train`); path None when the line runs no disttrain command."""
    tokens = line.split()
    for i, tok in enumerate(tokens):
        if tok == "disttrain" and (i == 0 or tokens[i - 1] == "-m"):
            break
    else:
        return None, [], []
    path, rest = (), tokens[i + 1:]
    while rest and path + (rest[0],) in commands:
        path, rest = path + (rest[0],), rest[1:]
    problems = []
    if rest and not rest[0].startswith(("-", "[")) and path not in leaf_commands(commands):
        problems.append(f"`disttrain {' '.join(path + (rest[0],))}`: no such command")
    return path, rest, problems


def readme_problems(text: str, commands=None) -> list[str]:
    """Commands and --flags the README shows that the parser lacks; a flag belongs to the command on
    its line, and a lone `--flag` in prose must be some command's."""
    commands = commands or cli_commands()
    every_flag = set().union(*commands.values())
    problems = []
    for line in readme_lines(text):
        path, rest, found = command_on(line, commands)
        problems += found
        if path is None:
            if line.startswith("--"):
                problems += [f"{flag} (in `{line}`): no command has it" for flag in FLAG.findall(line)
                             if flag not in every_flag]
            continue
        name = "disttrain " + " ".join(path)
        problems += [f"{flag}: `{name}` has no such option (README line: {line[:80]})"
                     for flag in FLAG.findall(" ".join(rest)) if flag not in commands[path]]
    return problems


def readme_missing_commands(text: str, commands=None) -> list[str]:
    """Commands of the CLI that no README command line shows."""
    commands = commands or cli_commands()
    shown = {command_on(line, commands)[0] for line in readme_lines(text)}
    return sorted(" ".join(p) for p in leaf_commands(commands) if p not in shown)


def test_readme_commands_and_flags_exist_in_the_cli():
    problems = readme_problems((REPO / "README.md").read_text())
    assert not problems, "README shows what the CLI lacks:\n" + "\n".join(problems)


def test_the_example_scripts_use_commands_and_flags_the_cli_has():
    for script in sorted((REPO / "examples").glob("*/*.sh")):
        problems = readme_problems(f"```bash\n{script.read_text()}\n```\n")
        assert not problems, f"{script} runs what the CLI lacks:\n" + "\n".join(problems)


def test_every_cli_command_appears_in_the_readme():
    missing = readme_missing_commands((REPO / "README.md").read_text())
    assert not missing, f"README never shows: {missing}"


def test_the_readme_checker_catches_renamed_flags_and_commands():
    commands = cli_commands()
    assert {("train",), ("bench", "comm"), ("bench", "hardware"), ("config", "export-deepspeed")} <= set(commands)
    assert "--nproc-per-node" in commands[("train",)]

    def problems(block: str) -> str:
        return "\n".join(readme_problems(f"```bash\n{block}\n```\n", commands))

    assert problems("disttrain train configs/demo.yaml --nproc-per-node 2") == ""
    assert "--bogus-flag" in problems("disttrain train configs/demo.yaml --bogus-flag 2")
    assert "--bogus-flag" in problems("torchrun --nproc-per-node 2 -m disttrain train c.yaml --bogus-flag")
    assert "--bogus-flag" in problems("disttrain plan --model 7b --gpus 8 \\\n    --bogus-flag 3")
    assert "--bogus-flag" in problems("disttrain estimate --model 7b\n                [--bogus-flag]")
    assert "--world-size" in problems("disttrain report RUN_DIR --world-size 2")  # another command's flag
    assert "--max-procs" in problems("disttrain bench comm --max-procs 4")
    assert "disttrain bogus" in problems("disttrain bogus --out x")
    assert "disttrain bench bogus" in problems("disttrain bench bogus")
    assert problems("disttrain train c.yaml  # --bogus-flag in a comment") == ""
    assert problems("torchrun --bogus-launcher-flag 2 -m disttrain train c.yaml") == ""  # torchrun's own
    assert "--bogus-flag" in "\n".join(readme_problems("Use `--bogus-flag` here.", commands))

    readme = (REPO / "README.md").read_text()
    renamed = readme.replace("--nproc-per-node", "--nprocs-per-node")
    assert any("--nprocs-per-node" in p for p in readme_problems(renamed, commands))
    assert "report" in readme_missing_commands(re.sub(r"disttrain report", "disttrain", readme), commands)


# ------------------------------------------------------------------ docs/architecture.md


def _doc_path_exists(name: str) -> bool:
    if name.startswith("src/"):
        return (REPO / name).exists()
    if name.startswith("disttrain/"):
        return (REPO / "src" / name).exists()
    if "/" in name:
        return (SRC / name).exists() or (REPO / name).exists()
    return (SRC / name).exists() or any(SRC.rglob(name))  # a bare name under its package in the layer list


def _mermaid_blocks() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    return [body for lang, body in FENCE.findall(text) if lang.strip() == "mermaid"]


def test_architecture_draws_every_import_between_packages_and_no_other():
    """The layer diagram's arrows (`a --> b & c`) are exactly the import graph between packages, read from the
    source as tests/test_architecture.py reads it (core/, which every package may import, left out)."""
    from import_graph import package_graph

    layers = next(b for b in _mermaid_blocks() if b.split()[0] in ("flowchart", "graph") and "config" in b)
    drawn = set()
    for line in layers.splitlines()[1:]:
        source, arrow, targets = line.strip().partition("-->")
        if arrow:
            drawn |= {(source.strip(), t.strip()) for t in targets.split("&")}
    imports = {edge for edge in package_graph() if edge[1] != "core"}
    assert not drawn - imports, f"drawn, but no such import: {sorted(drawn - imports)}"
    assert not imports - drawn, f"imports with no arrow: {sorted(imports - drawn)}"


def test_architecture_has_the_step_and_the_mesh():
    blocks = _mermaid_blocks()
    kinds = [body.split()[0] for body in blocks]
    assert "sequenceDiagram" in kinds
    graphs = [b for b, k in zip(blocks, kinds) if k in ("flowchart", "graph")]
    assert any(all(re.search(rf"\b{d}\b", b) for d in ("pp", "dp_shard", "tp")) for b in graphs), "the mesh"
    sequence = blocks[kinds.index("sequenceDiagram")]
    for step in ("train_step", "all-reduce", "optimizer.step", "COMMIT", "phase subscribers"):
        assert step in sequence, step


def test_architecture_names_only_modules_that_exist():
    text = (REPO / "docs" / "architecture.md").read_text()
    files = set(re.findall(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b", text))
    dirs = set(re.findall(r"`((?:src/)?(?:\w+/)+)`", text))
    modules = {m + ".py" for m, attr in re.findall(r"(?<![\w./-])((?:\w+/)+\w+)\.(\w+)", text)
               if attr not in ("py", "yaml", "md", "json")}  # train/builder.build_run -> train/builder.py
    assert {"train/loop.py", "config/resolve.py", "distributed/mesh.py"} <= files | modules and "src/disttrain/" in dirs
    missing = sorted(p for p in files | dirs | modules if not _doc_path_exists(p))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
