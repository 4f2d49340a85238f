"""The data keys against the model and each other, read without any tokens: `data.document_masking` needs an
end-of-document token, `data.packing` chat shards whose conversations it can keep apart, and the model's
vocabulary must hold the tokenizer's. `ctx` is the run being resolved (config/resolve.py's RunContext)."""

from __future__ import annotations

from disttrain.layout.problem import Problem


def data_problems(ctx) -> list[Problem]:
    from disttrain.data.source import PY_PREFIX, describe_source

    data, shape = ctx.cfg.data, ctx.shape
    source = data.source
    info = describe_source(source, ctx.tokenizer)
    problems = []
    if data.document_masking and isinstance(source, str) and source.startswith(PY_PREFIX):
        problems.append(Problem("data.document_masking", True, "false", "data.document_masking=true needs token "
                                f"windows with end-of-document tokens; data.source={source} gives (input, target) pairs "
                                "(allowed with it: false)"))
    elif data.document_masking and info.eos_id is None:
        problems.append(Problem("data.document_masking", True, "false", f"data.document_masking=true: the tokenizer of "
                                f"data.source={source} has no end-of-document token to mask at (allowed with it: false)"))
    problems += objective_problems(ctx)
    if data.packing and not problems:
        problems += _packing_problems(source)
    elif data.padding == "none" and not problems:
        problems += _packing_problems(source, "data.padding", "none", "longest")
    if shape is not None and shape.vocab_size < info.vocab_size:
        problems.append(Problem("model.vocab_size", shape.vocab_size, f"at least {info.vocab_size}",
                                f"model.vocab_size={shape.vocab_size} is smaller than the tokenizer's vocabulary "
                                f"({info.vocab_size} tokens from {info.tokenizer_name}); set model.vocab_size>="
                                f"{info.vocab_size}"))
    return problems


def _holds_pairs(source) -> bool:
    from disttrain.data.shards import read_meta

    return isinstance(source, str) and source != "builtin" and not source.startswith("py:") and \
        "preference" in read_meta(source)


def objective_problems(ctx) -> list[Problem]:
    """A preference objective trains on preference pairs, and pairs only with one (on the torch engine)."""
    cfg = ctx.cfg
    objective, source, layout = cfg.train.objective, cfg.data.source, ctx.layout
    pairs = _holds_pairs(source) or (ctx.data_planned and objective in ("dpo", "simpo", "orpo"))
    if objective in ("lm", "distill") and pairs:
        return [Problem("train.objective", objective, "dpo, simpo or orpo", f"data.source={source} holds preference "
                        f"pairs: train.objective={objective} would train on both completions alike (allowed for "
                        "pairs: dpo, simpo or orpo)")]
    if cfg.dpo.precompute_reference and objective != "dpo":
        return [Problem("dpo.precompute_reference", True, "false", f"dpo.precompute_reference=true with "
                        f"train.objective={objective}: only dpo has a reference model (allowed: false)")]
    if objective in ("lm", "distill"):
        return []
    if cfg.dpo.precompute_reference and isinstance(source, dict):
        return [Problem("dpo.precompute_reference", True, "false", "dpo.precompute_reference=true with a data.source "
                        "mixture: the reference's log-probabilities are kept per pair of one directory (allowed: "
                        "one preference directory, or false)")]
    if not pairs:
        shown = "a mixture" if isinstance(source, dict) else source
        return [Problem("train.objective", objective, "lm", f"train.objective={objective} needs preference pairs: "
                        f"data.source={shown} is not a `disttrain prepare-data` directory of preference records "
                        "(prompt, chosen, rejected; allowed on other data: lm)")]
    if cfg.engine != "torch":
        return [Problem("engine", cfg.engine, "torch", f"engine={cfg.engine} with train.objective={objective}: "
                        "preference pairs train with the torch engine, so far (allowed: torch)")]
    return []


def _packing_problems(source, key: str = "data.packing", value=True, instead="false") -> list[Problem]:
    """data.packing packs conversations of chat shard directories (preference pairs' sequences), kept apart at
    their end tokens; so does data.padding=none, one micro-batch at a time."""
    from disttrain.data.shards import read_meta

    setting = f"{key}={'true' if value is True else value}"
    for directory in (source if isinstance(source, dict) else [source]):
        meta = read_meta(directory) if directory != "builtin" and not str(directory).startswith("py:") else {}
        kind = "chat" if "chat" in meta else "preference" if "preference" in meta else None
        if kind is None:
            return [Problem(key, value, instead, f"{setting}: data.source={directory} is not chat data (text token "
                            "windows are packed already; allowed: a prepare-data directory of chat, instruction or "
                            f"preference records, or {key}={instead})")]
        inside = meta[kind].get("eos_inside")
        if inside is None:  # prepared before preference data counted them
            return [Problem(key, value, instead, f"{setting}: {directory} does not say whether its pairs hold the "
                            "end-of-document token inside; run `disttrain prepare-data` on it again (allowed for it: "
                            f"{key}={instead})")]
        if inside:
            what = "conversations" if kind == "chat" else "pairs"
            return [Problem(key, value, instead, f"{setting}: {inside} {what} of {directory} hold the end-of-document "
                            "token inside (the chat template ends turns with it), so document masking cannot keep "
                            f"them apart (allowed for it: {key}={instead})")]
    return []
