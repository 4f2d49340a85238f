"""The config reference (docs/config.md), rendered from the schema: one table per section with each key's type
or allowed values, default and description, and the registry's model shapes with their parameter counts.

    python -m disttrain.config.reference            print the page
    python -m disttrain.config.reference --write    write docs/config.md
    python -m disttrain.config.reference --check    exit 1 with one line if docs/config.md differs

Pure Python (pydantic and the shape table, no torch): it runs in well under a second.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from collections import Counter
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from disttrain.config.schema import RunConfig
from disttrain.models.hf.published import PUBLISHED_CONFIGS
from disttrain.models.registry import MODEL_SHAPES

PAGE = Path(__file__).resolve().parents[3] / "docs" / "config.md"
COMMAND = "python -m disttrain.config.reference --write"

INTRO = f"""\
<!-- Generated from the config schema (src/disttrain/config/) by `{COMMAND}`.
Edit the descriptions there and run that command; a test fails while this page is stale. -->

# Config reference

*Generated from the schema by `{COMMAND}`.*

A config is a YAML file with the sections below (examples in [configs/](../configs/)). Every key can be
overridden on the command line as `section.key=value`, for example `disttrain train configs/demo.yaml
optim.lr=1e-3 parallel.tp=2`. Unknown keys and bad values are refused before any process starts, with one
line naming the key, the value and what is allowed (exit code 2). An interval set to 0 switches that action
off. `parallel.dp_shard=-1` means whatever is left of the world size once the other degrees are taken.
A default shown as *empty* is a key left unset (YAML `null`); `""` is the empty string.
"""

# Where each section is explained at length (pages in docs/).
MORE = {
    "engine": "[parallelism.md, DeepSpeed](parallelism.md#deepspeed-engine-deepspeed)",
    "model": "[guide.md, Hugging Face models](guide.md#hugging-face-models-modelhfdir)",
    "model.lora": "[guide.md, LoRA adapters](guide.md#lora-adapters)",
    "model.moe": "[parallelism.md, expert parallelism](parallelism.md#expert-parallelism-parallelep)",
    "data": "[guide.md, Data](guide.md#data)",
    "parallel": "[parallelism.md](parallelism.md)",
    "precision": "[guide.md, Precision](guide.md#precision), "
                 "[parallelism.md, mixed precision](parallelism.md#mixed-precision-precision)",
    "checkpoint": "[guide.md, Checkpoints and resume](guide.md#checkpoints-and-resume)",
    "metrics": "[guide.md, Observability](guide.md#observability)",
    "distributed": "[guide.md, Fault tolerance](guide.md#fault-tolerance)",
    "run": "[guide.md, Resuming and the run directory](guide.md#resuming-and-the-run-directory)",
}

DENSE_COLUMNS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size", "max_seq_len",
                 "tie_embeddings", "rope_theta")
MOE_COLUMNS = ("dim", "n_layers", "n_heads", "n_kv_heads", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "n_shared_experts", "vocab_size")


# ------------------------------------------------------------------ values, types and descriptions as text
def number(value) -> str:
    """A number as a user writes it: `3e-4`, `1e-8`, `25`, `0.1` (no `25.0`, no `1e-08`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    text = f"{value:g}"
    if value and "e" not in text and abs(value) < 1e-3:
        text = f"{value:e}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
        text = f"{mantissa}e{int(exponent)}"
    return text


def value_text(value) -> str:
    """A default as YAML would hold it."""
    if value is None:
        return "*empty*"
    if isinstance(value, (bool, int, float)):
        return f"`{number(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value in ("", " ") or value != value.strip() else f"`{value}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(number(v) if isinstance(v, (int, float)) else str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}`"
    return f"`{value}`"


def bounds(info: FieldInfo) -> str:
    """The field's numeric bounds, `> 0`, `≥ -1`, `0 to 3`, `[0, 1)`."""
    low = high = ""
    for item in info.metadata:
        if isinstance(item, annotated_types.Gt):
            low = f"> {number(item.gt)}"
        elif isinstance(item, annotated_types.Ge):
            low = f"≥ {number(item.ge)}"
        elif isinstance(item, annotated_types.Lt):
            high = f"< {number(item.lt)}"
        elif isinstance(item, annotated_types.Le):
            high = f"≤ {number(item.le)}"
    if low.startswith("≥") and high.startswith("≤"):
        return f"{low[2:]} to {high[2:]}"
    if low and high:
        return f"{'[' if low.startswith('≥') else '('}{low[2:]}, {high[2:]}{']' if high.startswith('≤') else ')'}"
    return low or high


def _args(annotation) -> tuple:
    return typing.get_args(annotation)


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def type_text(annotation, info: FieldInfo | None = None) -> str:
    """The type column: a Literal's values, or the type in words with its bounds."""
    if _is_union(annotation):
        parts = [a for a in _args(annotation) if a is not type(None)]
        text = " or ".join(type_text(a, info) for a in parts)
        return text + (" or empty" if len(parts) < len(_args(annotation)) else "")
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return ", ".join(f"`{number(v) if not isinstance(v, str) else v}`" for v in _args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if origin in (list, tuple):
        items = _args(annotation)
        if origin is tuple and items and Ellipsis not in items:
            return f"{len(items)} {type_text(items[0])}s"
        return f"list of {type_text(items[0])}s" if items else "list"
    if origin is dict:
        return "map {" + ": ".join(type_text(a) for a in _args(annotation)) + "}"
    words = {bool: "`true`, `false`", int: "integer", float: "number", str: "string"}
    text = words.get(annotation, getattr(annotation, "__name__", str(annotation)))
    limit = bounds(info) if info is not None and annotation in (int, float) else ""
    return f"{text} {limit}" if limit else text


def all_keys(section: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, FieldInfo]:
    """Every key of the schema by its dotted name as written in configs (aliases: `checkpoint.async`),
    sub-sections included (`model.lora.rank`)."""
    keys = {}
    for name, info in section.model_fields.items():
        key = prefix + (info.alias or name)
        keys[key] = info
        sub = _section_of(info.annotation)
        if sub is not None:
            keys.update(all_keys(sub, key + "."))
    return keys


def _section_of(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


KEYS = all_keys()
LEAVES = Counter(key.rsplit(".", 1)[-1] for key in KEYS)  # a bare name is coded only when one key has it
TOKEN = re.compile(r"(?<![\w./<-])([a-z][a-z0-9_]*(?:[./][a-z][a-z0-9_]*)*)(=[\w.-]+)?(?![\w/(.-])")
ENV = re.compile(r"(?<![\w`])([A-Z][A-Z0-9]*_[A-Z0-9_]+(?:=\w+)?)(?!\w)")
DOC_LINK = re.compile(r"(?<![\w/])docs/([\w-]+\.md)")


def prose(text: str, prefix: str) -> str:
    """A description as table cell Markdown: config keys in code (dotted, `data.seq_len`, or with an underscore
    and either this section's or the only key of that name, `zero_stage`), environment variables in code,
    docs/ pages linked, `<`, `|` and `*` escaped outside code."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # outside the description's own code spans
        piece = pieces[i].replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")

        def known(key: str) -> bool:
            return ("." in key and key in KEYS) or ("_" in key and (prefix + key in KEYS or LEAVES.get(key) == 1))

        def code(match: re.Match) -> str:  # run.dir/run.name: every part a key
            return f"`{match.group(0)}`" if all(map(known, match.group(1).split("/"))) else match.group(0)

        piece = ENV.sub(r"`\1`", TOKEN.sub(code, piece))
        pieces[i] = DOC_LINK.sub(r"[\1](\1)", piece)
    return "`".join(pieces)


# ------------------------------------------------------------------ the tables
def _default(info: FieldInfo):
    if info.default_factory is not None:
        return info.default_factory()
    return None if info.default is PydanticUndefined else info.default


def section_table(section: type[BaseModel], prefix: str, heading: str, level: str = "##") -> list[str]:
    """One section's heading, its docstring, a pointer to its longer explanation and its table."""
    doc = (section.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"{level} {heading}", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    if prefix.rstrip(".") in MORE:
        lines += [f"More: {MORE[prefix.rstrip('.')]}.", ""]
    lines += ["| key | type / allowed values | default | description |", "|---|---|---|---|"]
    for name, info in section.model_fields.items():
        key = prefix + (info.alias or name)
        sub = _section_of(info.annotation)
        if sub is not None:
            kind = type_text(info.annotation).replace("section", f"section ([below](#{key.replace('.', '')}))")
            default = "*empty*" if info.default is None else "see below"
        else:
            kind, default = type_text(info.annotation, info), value_text(_default(info))
        lines.append(f"| `{key}` | {kind} | {default} | {prose(info.description or '', prefix)} |")
    return lines + [""]


def params(count: int) -> str:
    """A parameter count as the shape tables write it: `0.13M`, `134.11M`, `6.74B`."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def shape_cells(shape, columns) -> list[str]:
    values = {**vars(shape), **(vars(shape.moe) if shape.moe is not None else {})}
    return [number(values[c]) for c in columns]


def _differing(shapes: dict, key: str, value, otherwise: str) -> str:
    """`head_dim` 128 in `a` and `b` (otherwise ...): the shapes where `value(shape)` is not None, by value."""
    groups: dict[str, list[str]] = {}
    for name, shape in shapes.items():
        if value(shape) is not None:
            groups.setdefault(number(value(shape)), []).append(f"`{name}`")
    if not groups:
        return ""
    found = ", ".join(f"`{v}` in {' and '.join(names)}" for v, names in groups.items())
    return f"`{key}` is {found} ({otherwise})"


def shape_tables() -> list[str]:
    """The registry's dense and mixture-of-experts shapes (`model.name`), each row with its parameter count
    (and for MoE the active count: the experts one token runs through)."""
    llama = {n: s for n, s in MODEL_SHAPES.items() if n not in PUBLISHED_CONFIGS}
    dense = {n: s for n, s in llama.items() if s.moe is None}
    moe = {n: s for n, s in llama.items() if s.moe is not None}
    eps = sorted({number(s.norm_eps) for s in dense.values()})
    lines = ["### Registry shapes (`model.name`)", "",
             "Any shape key overrides a shape's value. Dense shapes (`norm_eps` is "
             f"{' or '.join(f'`{e}`' for e in eps)} in all; the parameter count includes the embedding):", ""]
    header = ("name",) + DENSE_COLUMNS + ("parameters",)
    lines += ["| " + " | ".join(f"`{h}`" if h != "parameters" else h for h in header) + " |",
              "|" + "---|" * len(header)]
    lines += [f"| `{n}` | " + " | ".join(shape_cells(s, DENSE_COLUMNS) + [params(s.num_params())]) + " |"
              for n, s in dense.items()]
    notes = [_differing(moe, "head_dim", lambda s: s.head_dim if s.head_size else None, "otherwise `dim` / "
                        "`n_heads`"), _differing(moe, "norm_eps", lambda s: s.norm_eps if s.norm_eps != 1e-5 else None,
                                                 "otherwise `1e-5`")]
    notes = [n for n in notes if n]
    lines += ["", "Mixture-of-experts shapes: the same blocks with the MLP replaced by a router over SwiGLU "
              "experts; *active* counts the experts one token runs through. `first_k_dense_replace` leading blocks "
              "keep a dense MLP of `ffn_hidden_dim`." + "".join(f" {note}." for note in notes), ""]
    header = ("name",) + MOE_COLUMNS + ("parameters", "active")
    lines += ["| " + " | ".join(f"`{h}`" if h not in ("parameters", "active") else h for h in header) + " |",
              "|" + "---|" * len(header)]
    lines += [f"| `{n}` | " + " | ".join(shape_cells(s, MOE_COLUMNS)
                                         + [params(s.num_params()), params(s.num_params(active=True))]) + " |"
              for n, s in moe.items()]
    lines += ["", "Published models whose blocks are not Llama's, as transformers builds them from the model "
              "card's config.json (shape keys are refused: `model.hf` takes an edited config.json); they take tensor "
              "parallelism (the fused experts whole on every rank), gpt-oss and DeepSeek-V3 context parallelism too, "
              "and the planner proposes both where they take them "
              "([models.md](models.md#which-layouts-each-family-takes)):", "",
              "| `name` | model type | layers | experts (top-k) | parameters | active | besides Llama's block |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| `{n}` | `{PUBLISHED_CONFIGS[n]['model_type']}` | {s.n_layers} | {s.moe.num_experts} "
              f"({s.moe.num_experts_per_tok}) | {params(s.num_params())} | {params(s.num_params(active=True))} | "
              f"{_published_blocks(s)} |" for n, s in MODEL_SHAPES.items() if n in PUBLISHED_CONFIGS]
    return lines + [""]


def _published_blocks(shape) -> str:
    """What a published model's blocks add, in a few words."""
    x, parts = shape.extras, []
    if shape.mla is not None:
        parts.append(f"latent attention (kv rank {shape.mla.kv_lora_rank}, q rank {shape.mla.q_lora_rank})")
    if x is not None and x.attention_sinks:
        parts.append("attention sinks")
    if x is not None and x.sliding_layers:
        parts.append(f"{x.sliding_layers} layers with a {x.sliding_window}-token window")
    if x is not None and x.linear is not None:
        parts.append(f"{x.linear.layers} Gated DeltaNet layers")
    if shape.moe.n_shared_experts:
        parts.append(f"{shape.moe.n_shared_experts} shared expert")
    return "; ".join(parts)


def render() -> str:
    """The whole page."""
    lines = [INTRO]
    top = {n: i for n, i in RunConfig.model_fields.items() if _section_of(i.annotation) is None}
    sections = {n: i for n, i in RunConfig.model_fields.items() if n not in top}
    lines += ["Sections: " + ", ".join(["[top level](#top-level)"] + [f"[`{n}`](#{n})" for n in sections]) + ".",
              ""]
    lines += ["## Top level", "", f"More: {MORE['engine']}.", "",
              "| key | type / allowed values | default | description |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {type_text(i.annotation, i)} | {value_text(_default(i))} | {prose(i.description, '')} |"
              for n, i in top.items()] + [""]
    for name, info in sections.items():
        section = _section_of(info.annotation)
        lines += section_table(section, f"{name}.", f"`{name}`")
        for sub_name, sub_info in section.model_fields.items():
            sub = _section_of(sub_info.annotation)
            if sub is not None:
                key = f"{name}.{sub_info.alias or sub_name}"
                lines += section_table(sub, key + ".", f"`{key}`", "###")
        if name == "model":
            lines += shape_tables()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"], ["--check"]):
        print(f"usage: python -m disttrain.config.reference [--write | --check] (got {' '.join(argv)})",
              file=sys.stderr)
        return 2
    page = render()
    if not argv:
        sys.stdout.write(page)
    elif argv == ["--write"]:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(PAGE.parents[1])}")
    elif not PAGE.is_file() or PAGE.read_text() != page:
        print(f"{PAGE.relative_to(PAGE.parents[1])} is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
