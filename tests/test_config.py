"""Config loading and the one-line, exit-2 contract for user mistakes (real CLI subprocesses)."""

from __future__ import annotations

import pytest
import yaml

from disttrain.config.load import load_config
from disttrain.config.overrides import parse_overrides
from disttrain.config.schema import RunConfig
from disttrain.core.errors import ConfigError
from disttrain.config.resolve import resolve_run
from helpers import DEBUG_CONFIG, REPO, run_cli


def test_yaml_and_overrides_resolve():
    cfg = load_config(DEBUG_CONFIG, ["optim.lr=3e-4", "parallel.dp_shard=2", "train.steps=7", "run.name=x"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.parallel.dp_shard == 2 and cfg.train.steps == 7
    assert cfg.model.name == "debug"  # from the file
    assert cfg.run_dir.name == "x"


def test_run_name_defaults_to_config_stem():
    assert load_config(DEBUG_CONFIG).run.name == "debug"


def test_resolved_yaml_shows_the_shape_and_round_trips():
    """config.yaml holds the model's dimensions (the debug shape with one override), not nulls, and loads
    back as the same run."""
    cfg = load_config(DEBUG_CONFIG, ["checkpoint.every_steps=5", "model.n_layers=3"])
    tree = yaml.safe_load(cfg.to_yaml(resolve_run(cfg, 2, "cpu")))
    assert {k: v for k, v in tree["model"].items() if k not in ("name", "hf", "spec", "init_from", "attn_implementation")} == {
        "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_hidden_dim": 192,
        "max_seq_len": 256, "tie_embeddings": False, "norm_eps": 1e-5, "rope_theta": 10000.0}
    again = RunConfig.model_validate(tree)
    assert again.model_dump(exclude={"model"}) == cfg.model_dump(exclude={"model"})
    assert again.to_yaml(resolve_run(again, 2, "cpu")) == cfg.to_yaml(resolve_run(cfg, 2, "cpu"))


def test_override_parsing_nests_and_types():
    assert parse_overrides(["a.b=1", "a.c=true", "d=x"]) == {"a": {"b": 1, "c": True}, "d": "x"}
    with pytest.raises(ConfigError):
        parse_overrides(["novalue"])


def test_world_size_checks():
    cfg = load_config(DEBUG_CONFIG, ["train.global_batch_size=4", "train.micro_batch_size=2"])
    resolve_run(cfg, 2, "cuda")
    with pytest.raises(ConfigError, match="per-rank batch"):
        resolve_run(load_config(DEBUG_CONFIG, ["train.global_batch_size=4", "train.micro_batch_size=4"]), 2, "cuda")
    with pytest.raises(ConfigError, match="does not equal the world size 2"):
        resolve_run(load_config(DEBUG_CONFIG, ["parallel.dp_shard=4"]), 2, "cuda")


# (overrides, launch args, text the single line must contain)
MISTAKES = {
    "unknown key": (["model.depth=3"], [], "model.depth: unknown key (allowed in model: name, hf, spec, dim"),
    "unknown section": (["trainer.steps=3"], [], "trainer: unknown key (allowed in the top level: engine, model"),
    "wrong type": (["train.steps=abc"], [], "train.steps=abc: input should be a valid integer"),
    "negative lr": (["optim.lr=-1"], [], "optim.lr=-1: input should be greater than 0"),
    "bad choice": (["parallel.ddp_comm_hook=zip"], [], "parallel.ddp_comm_hook=zip: input should be 'none', 'fp16'"),
    "micro batch does not divide global": (["train.global_batch_size=6", "train.micro_batch_size=4"], [],
                                           "train.global_batch_size=6 is not a multiple of train.micro_batch_size=4"),
    "batch does not split over ranks": (["train.global_batch_size=3"], ["--nproc-per-node", "2"],
                                        "train.global_batch_size=3 is not divisible by the data-parallel size 2"),
    "dims product is not the world size": (["parallel.dp_replicate=2", "parallel.dp_shard=2"],
                                           ["--nproc-per-node", "2"],
                                           "parallel.dp_replicate=2 x parallel.dp_shard=2 x parallel.tp=1 x "
                                           "parallel.pp=1 = 4 does not equal the world size 2"),
    "missing data path": (["data.source=/nonexistent/shards"], [], "data.source=/nonexistent/shards: no such directory"),
    "heads do not divide": (["model.n_kv_heads=3"], [], "model.n_kv_heads=3 does not divide model.n_heads=4"),
    "seq longer than model": (["data.seq_len=1024"], [], "data.seq_len=1024 exceeds model.max_seq_len=256"),
    "tensor parallel under DDP": (["parallel.tp=2", "model.n_layers=2"], ["--nproc-per-node", "4"],
                                  "parallel.tp=2 with 2 data-parallel ranks needs parallel.zero_stage 2 or 3"),
    "fp16 under a pipeline": (["parallel.pp=2", "precision.compute_dtype=fp16"], [],
                              "precision.compute_dtype=fp16 with parallel.pp=2"),
    "tensor parallel under DeepSpeed": (["engine=deepspeed", "parallel.tp=2"], [],
                                        "tensor and pipeline parallelism need engine=torch"),
    "tp does not divide heads": (["parallel.tp=3"], [], "parallel.tp=3 does not divide model.n_heads=4"),
    "more stages than layers": (["parallel.pp=4"], [], "parallel.pp=4 x 1 stage(s) per rank = 4 stages exceeds "
                                                       "model.n_layers=2"),
    "pipeline microbatches": (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=4",
                               "train.global_batch_size=6", "parallel.pp_microbatches=3"], ["--nproc-per-node", "2"],
                              "parallel.pp_microbatches=3 must be a multiple of parallel.pp=2"),
    "zero-bubble under selective checkpointing": (  # found by the dry run; the real run raised mid-step
        ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.activation_checkpointing=selective",
         "model.n_layers=4", "train.global_batch_size=4"], ["--nproc-per-node", "2"],
        "parallel.activation_checkpointing=selective with parallel.pp_schedule=zero_bubble"),
    "zero-bubble under full checkpointing": (  # real runs held more than without checkpointing
        ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.activation_checkpointing=full",
         "model.n_layers=4", "train.global_batch_size=4"], ["--nproc-per-node", "2"],
        "parallel.activation_checkpointing=full with parallel.pp_schedule=zero_bubble"),
    "zero-bubble under ZeRO-3": (  # a real run's weight passes missed resharded parameters: grad norm 8.52, not 12.62
        ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.zero_stage=3", "model.n_layers=4",
         "train.global_batch_size=4"], ["--nproc-per-node", "2"],
        "parallel.zero_stage=3 with parallel.pp_schedule=zero_bubble"),
    "offload without sharding": (["parallel.cpu_offload=true"], [],
                                 "parallel.cpu_offload=true needs parallel.zero_stage 2 or 3 (FSDP2), not 0"),
    "sharded accumulation under DDP": (["parallel.gradient_accumulation=sharded", "train.micro_batch_size=1"], [],
                                       "parallel.gradient_accumulation=sharded needs parallel.zero_stage 2 or 3 "
                                       "(FSDP2), not 0"),
    "sharded accumulation under zero-bubble": (
        ["parallel.gradient_accumulation=sharded", "parallel.zero_stage=2", "parallel.pp=2",
         "parallel.pp_schedule=zero_bubble", "model.n_layers=4", "train.global_batch_size=4"],
        ["--nproc-per-node", "2"],
        "parallel.gradient_accumulation=sharded with parallel.pp_schedule=zero_bubble"),
    "sharded accumulation under uneven shares": (
        ["parallel.gradient_accumulation=sharded", "parallel.zero_stage=3", "parallel.balance=auto",
         "train.micro_batch_size=1"], [], "parallel.gradient_accumulation=sharded with uneven shares"),
    "sharded accumulation under DeepSpeed": (["parallel.gradient_accumulation=sharded", "parallel.zero_stage=3",
                                             "engine=deepspeed"], [],
                                            "parallel.gradient_accumulation=sharded needs engine=torch, not deepspeed"),
    "param dtype under DDP": (["precision.param_dtype=bf16"], [],
                              "precision.param_dtype=bf16 needs parallel.zero_stage 2 or 3"),
    "DDP hook under FSDP": (["parallel.zero_stage=3", "parallel.ddp_comm_hook=fp16"], [],
                            "parallel.ddp_comm_hook=fp16 applies to DDP (zero_stage 0 or 1), not zero_stage=3"),
    "zero stage out of range": (["parallel.zero_stage=4"], [], "parallel.zero_stage=4: input should be less than or equal to 3"),
    "balance weights per rank": (["parallel.balance_weights=[1,2,3]", "train.micro_batch_size=1"],
                                 ["--nproc-per-node", "2"], "parallel.balance_weights=[1.0, 2.0, 3.0]: 3 weight(s) "
                                 "for 2 data-parallel rank(s)"),
    "balance without micro-batches": (["parallel.balance=auto"], [],
                                      "parallel.balance=auto needs train.micro_batch_size > 0"),
    "balance under a pipeline": (["parallel.balance=auto", "parallel.pp=2", "train.micro_batch_size=1"], [],
                                 "parallel.balance=auto with parallel.pp=2: a pipeline schedule runs the same"),
    "balance weight not positive": (["parallel.balance_weights=[1,0]", "train.micro_batch_size=1"], [],
                                    "parallel.balance_weights=[1.0, 0.0]: every weight must be positive"),
    "balance fewer micro-batches than ranks": (["parallel.balance_weights=[1,1]", "train.micro_batch_size=4"],
                                               ["--nproc-per-node", "2"], "= 1 micro-batches, fewer than the 2"),
    "balance with buffer broadcast": (["parallel.balance=auto", "train.micro_batch_size=1",
                                       "parallel.ddp_broadcast_buffers=true"], [],
                                      "parallel.ddp_broadcast_buffers=true broadcasts buffers in every forward"),
    "balance under DeepSpeed": (["parallel.balance=auto", "train.micro_batch_size=1", "engine=deepspeed"], [],
                                "parallel.balance=auto needs engine=torch"),
    "HSDP under DeepSpeed": (["engine=deepspeed", "parallel.dp_replicate=2"], [],
                             "parallel.dp_replicate=2 needs engine=torch (HSDP)"),
}


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI entry point in this process (what `disttrain ...` runs): (exit code, stdout, stderr)."""
    from disttrain.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def assert_one_line_exit_2(code: int, out: str, err: str, expected: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("disttrain: error: ") and expected in lines[0], lines[0]
    assert lines[0].count("disttrain:") == 1, lines[0]  # one prefix (it used to read "disttrain: error: disttrain:")
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("name", list(MISTAKES))
def test_user_mistake_is_one_line_exit_2(name, tmp_path, capsys):
    overrides, launch, expected = MISTAKES[name]
    assert_one_line_exit_2(*run_main(capsys, "train", str(DEBUG_CONFIG), f"run.dir={tmp_path}", *overrides, *launch),
                           expected)
    assert not any(tmp_path.iterdir()), "a refused run must leave nothing behind"


ARGUMENT_MISTAKES = {
    "no config": (["train"], "disttrain: error: train: the following arguments are required: config"),
    "unknown command": (["fly"], "disttrain: error: argument command: invalid choice: 'fly'"),
    "unknown flag": (["train", str(DEBUG_CONFIG), "--bogus"], "unrecognized arguments: --bogus"),
    "bad flag value": (["plan", "--gpus", "many"], "argument --gpus: invalid int value: 'many'"),
    "launch flag without --nproc-per-node": (["train", str(DEBUG_CONFIG), "--nnodes", "2", "--max-restarts", "3"],
                                             "--nnodes needs --nproc-per-node N"),
    "shutdown timeout without --nproc-per-node": (["train", str(DEBUG_CONFIG), "--shutdown-timeout", "60"],
                                                  "--shutdown-timeout needs --nproc-per-node N"),
    "malformed rdzv conf": (["train", str(DEBUG_CONFIG), "--nproc-per-node", "2", "--rdzv-conf", "last_call_timeout"],
                            "--rdzv-conf=last_call_timeout: 'last_call_timeout' is not key=value"),
    "negative exit barrier": (["train", str(DEBUG_CONFIG), "--nproc-per-node", "2", "--exit-barrier-timeout", "-1"],
                              "--exit-barrier-timeout=-1: must be at least 0 seconds"),
    "nccl without CUDA": (["train", str(DEBUG_CONFIG), "distributed.backend=nccl"],
                          "distributed.backend=nccl needs CUDA devices and none are visible"),
}


@pytest.mark.parametrize("name", list(ARGUMENT_MISTAKES))
def test_argument_mistake_is_one_line_exit_2(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, expected = ARGUMENT_MISTAKES[name]
    assert_one_line_exit_2(*run_main(capsys, *args), expected)
    assert not any(tmp_path.iterdir())


def test_missing_config_file_and_bad_yaml(tmp_path):
    proc = run_cli("train", str(tmp_path / "nope.yaml"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    proc = run_cli("train", str(bad), check=False)
    assert proc.returncode == 2 and "line 2 is not valid YAML" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_shipped_configs_validate():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path)
        p = cfg.parallel
        world = 2 if p.dp_shard == -1 else p.dp_replicate * p.dp_shard * p.tp * p.pp
        resolve_run(cfg, world, "cuda")
