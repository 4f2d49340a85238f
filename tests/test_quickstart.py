"""The README's Quickstart runs in order as written after `make demo`, each training line training what it
says: its own run, from step 1 (shortened to 2 steps; the sample and validation off). Lines that plan rather
than train are checked against the parser by test_docs.py."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from disttrain.cli import build_parser
from disttrain.config.load import load_config
from disttrain.config.resolve import resolve_run
from helpers import REPO, cli_env, records, run_module
from test_docs import FENCE, logical_lines

SHORT = ("train.steps=2", "optim.warmup_steps=1", "train.eval_every=0", "train.sample_tokens=0",
         "checkpoint.every_steps=0", "metrics.comm_profile_every=0", "metrics.log_every=1", "distributed.timeout_s=60")


# Run name -> the layout the README's words give its line, spelled as Layout.describe() spells it (the run's
# `started` event): data parallel on 2 processes (zero=0: DDP), ZeRO-3 through FSDP2, tensor + sequence parallel,
# the interleaved pipeline (2 micro-batches: the per-rank batch of 16 / micro-batch 8), ring context parallel.
CLAIMED = {"demo": "dp=2 zero=0", "debug": "dp=1 zero=0", "demo-lr1e-3": "dp=2 zero=0", "demo-torchrun": "dp=2 zero=0",
           "fsdp": "dp=2 zero=3", "demo-tp": "dp=1 zero=0 tp=2 sp", "demo-pp": "dp=1 zero=0 pp=2 interleaved_1f1b m=2",
           "demo-cp": "dp=1 zero=0 cp=2 ring", "mycorpus": "dp=1 zero=0", "sft": "dp=2 zero=0",
           "dpo": "dp=2 zero=0", "demo-ray": "dp=2 zero=0"}


def quickstart_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = next(block for lang, block in FENCE.findall(section) if lang.strip() == "bash")
    return logical_lines(block)


def make_demo_line() -> str:
    recipe = (REPO / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()[1].strip()
    return recipe.replace("$(BIN)/", "").replace("$(NPROC)", "auto")


def training(line: str) -> tuple[str, list[str]] | None:
    """(config, overrides) of a line that trains, else None."""
    tokens = shlex.split(line)
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # an environment setting before the command
        tokens = tokens[1:]
    if "train" not in tokens or not any(t in ("disttrain", "torchrun") for t in tokens[:1]):
        return None
    rest = tokens[tokens.index("train") + 1:]
    return rest[0], [t for t in rest[1:] if "=" in t and not t.startswith("-")]


def nproc(line: str) -> int:
    if "--ray" in line:  # Ray Train's workers: --workers N, by default 2 on CPU
        found = re.search(r"--workers[ =](\d+)", line)
        return int(found.group(1)) if found else 2
    found = re.search(r"--nproc[-_]per[-_]node[ =](\w+)", line)
    return 1 if not found else 2 if found.group(1) == "auto" else int(found.group(1))


def _inputs(cwd: Path) -> None:
    """What the prepare-data line reads: some text files, a JSONL file and a Parquet shard (the project's docs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = sorted((REPO / "docs").glob("*.md"))
    (cwd / "corpus").mkdir()
    (cwd / "shards").mkdir()
    for doc in docs[:2]:
        (cwd / "corpus" / f"{doc.stem}.txt").write_text(doc.read_text())
    paragraphs = [p for doc in docs[2:] for p in doc.read_text().split("\n\n") if p.strip()]
    half = len(paragraphs) // 2
    (cwd / "data.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:half]))
    pq.write_table(pa.table({"text": paragraphs[half:]}), cwd / "shards" / "part-0.parquet")


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _chat_inputs(cwd: Path) -> dict:
    """What the fine-tuning and DPO lines read, offline: a Hugging Face cache holding, under the README's Hub ids, a
    chat dataset, a preference dataset (examples/dpo's pairs) and a model with its tokenizer and chat template
    (examples/sft's tiny Llama and BPE, made here, its positions raised to the lines' 1024). Returns the
    environment that points huggingface_hub at it."""
    spec = importlib.util.spec_from_file_location("make_assets", REPO / "examples" / "sft" / "make_assets.py")
    make_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_assets)
    make_assets.main(cwd / "sft-assets")
    readme = (REPO / "README.md").read_text()
    line = readme.split("disttrain prepare-data ", 2)[2].splitlines()[0]  # the fine-tuning one, the second
    data_id, model_id = line.split()[0], line.split("--tokenizer ", 1)[1].split()[0]
    pairs_id = readme.split("disttrain prepare-data ", 3)[3].split()[0]  # the DPO one, the third
    spec = importlib.util.spec_from_file_location("make_pairs", REPO / "examples" / "dpo" / "make_pairs.py")
    make_pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_pairs)
    chats = [json.loads(row) for row in (cwd / "sft-assets" / "chats.jsonl").read_text().splitlines()]
    pairs = make_pairs.make_pairs(chats)
    (cwd / "sft-assets" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    hub = cwd / "hf-cache"
    for kind, repo, records in (("models", model_id, None), ("datasets", data_id, "chats.jsonl"),
                                ("datasets", pairs_id, "pairs.jsonl")):
        root = hub / f"{kind}--{repo.replace('/', '--')}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(HUB_COMMIT)
        snapshot = root / "snapshots" / HUB_COMMIT
        if kind == "models":
            shutil.copytree(cwd / "sft-assets" / "base", snapshot)
            shutil.copytree(cwd / "sft-assets" / "tokenizer", snapshot, dirs_exist_ok=True)
            config = json.loads((snapshot / "config.json").read_text())
            (snapshot / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
        else:
            (snapshot / "data").mkdir(parents=True)
            shutil.copy(cwd / "sft-assets" / records, snapshot / "data" / "train.jsonl")
    return {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}


def test_quickstart_after_make_demo_trains_what_each_line_says(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    _inputs(tmp_path)
    hub = _chat_inputs(tmp_path)
    env = {**cli_env(), "PATH": f"{Path(sys.executable).parent}:{cli_env()['PATH']}", **hub}
    lines = [make_demo_line(), *quickstart_lines()]
    seen: dict[Path, str] = {}
    trained: dict[str, str] = {}  # run name -> the layout its `started` event names
    for i, line in enumerate(lines):
        if line.startswith(("make ", "disttrain estimate", "disttrain plan", "disttrain dryrun")):
            continue
        train = training(line)
        if train is not None:
            with _environ(hub):
                cfg = load_config(tmp_path / train[0], train[1])
            run_dir = tmp_path / cfg.run_dir
            assert run_dir not in seen, f"`{line}` trains into {cfg.run_dir}, as `{seen.get(run_dir)}` does"
            seen[run_dir] = line
            if nproc(line) > 2:  # the 3D line needs 8 processes: its layouts run in test_model_parallel.py
                continue
            # the context-parallel line keeps its sample: generation cannot run on sequence shards, so the run
            # must say why it skips it rather than fail after training
            short = [o for o in SHORT if not ("parallel.cp" in line and o.startswith("train.sample_tokens"))]
            line = " ".join([line.split("#")[0], *short])
        proc = _run_line(line, tmp_path, env, through_shell=i == 0)
        assert proc.returncode == 0, f"`{line}` exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        if "parallel.cp" in line:
            assert "no sample: generation needs whole sequences" in proc.stdout, proc.stdout[-2000:]
        if train is not None:
            steps = [r["step"] for r in records(run_dir) if "loss" in r]
            assert steps == [1, 2] and not any(r.get("event") == "resumed" for r in records(run_dir)), line
            # the layout it trained, from its run's `started` event, is the one its config and overrides give on
            # the processes it asks for
            (started,) = [r for r in records(run_dir) if r.get("event") == "started"]
            with contextlib.chdir(tmp_path), _environ(hub):  # the line's relative paths (data.source), its Hub ids
                claimed = resolve_run(load_config(tmp_path / train[0], train[1]), nproc(line), "cpu").layout
            assert (started["world_size"], started["layout"]) == (nproc(line), claimed.describe()), line
            trained[cfg.run.name] = started["layout"]
    assert len(seen) == 13  # make demo, the twelve training lines (fine-tuning, DPO, Ray, context parallel among them)
    assert trained == CLAIMED  # what the README says each line trains (the 3D line runs elsewhere)


# The commands a line may start with, as the module `python -m` runs for them.
MODULES = {"disttrain": "disttrain", "torchrun": "torch.distributed.run"}


def _run_line(line: str, cwd: Path, env: dict, through_shell: bool) -> subprocess.CompletedProcess:
    """One README line as a shell runs it: `make demo`'s line through the shell and the installed `disttrain`
    script; the others as the same module with the same arguments (globs expanded, leading VAR=value settings
    in the environment), forked from the suite's pre-imported interpreter to save its start-up."""
    tokens = shlex.split(line, comments=True)
    settings = {}
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        settings[key] = value
    if through_shell or tokens[0] not in MODULES or any(t in ("|", "||", "&&", ";", ">", "<") for t in tokens):
        return subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    args = [a for token in tokens[1:] for a in (sorted(str(p.relative_to(cwd)) for p in cwd.glob(token))
                                                    if "*" in token else [token])]
    return run_module(MODULES[tokens[0]], args, env={**env, **settings}, cwd=cwd, timeout=600)


@contextlib.contextmanager
def _environ(values: dict):
    """huggingface_hub reads its cache and offline settings once, at import: set them on its constants too."""
    from huggingface_hub import constants

    saved = {k: os.environ.get(k) for k in values}
    kept = (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)
    os.environ.update(values)
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = values["HF_HUB_CACHE"], True
    try:
        yield
    finally:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = kept
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_torchruns_spelling_of_the_launch_flags_is_accepted():
    args, _ = build_parser().parse_known_args(["train", "configs/demo.yaml", "--nproc_per_node", "2",
                                               "--max_restarts", "1", "--rdzv_endpoint", "h:1"])
    assert (args.nproc_per_node, args.max_restarts, args.rdzv_endpoint) == ("2", 1, "h:1")
