"""What the console and the report show is what happened: the start line's layout in the config's words,
and the report's learning-rate and gradient-norm plots, resume and layout-change markers, memory from
zero, per-source validation curves and the pipeline's asynchronous transfers labelled as such.
In-process, on configs and a hand-written metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from disttrain.config.load import load_config
from disttrain.observe.run_report import figures, load_records, run_starts, summary
from disttrain.config.resolve import resolve_run
from helpers import DEBUG_CONFIG


@pytest.mark.parametrize("overrides,world,expected", [
    (["parallel.zero_stage=3"], 2, "dp=2 zero=3"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, "dp=1 zero=0 tp=2 sp"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=4", "train.global_batch_size=8",
      "train.micro_batch_size=1"], 2, "dp=1 zero=0 pp=2 interleaved_1f1b m=8"),
    (["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero_stage=3"], 4,
     "dp=4 (2 replicas x 2 shards) zero=3"),
    # ZeRO-2 over the context pair in each of 2 replicas: not the same cut as dp_shard=2 (shards over 4 ranks)
    (["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.cp=2", "parallel.zero_stage=2"], 4,
     "dp=2 (2 replicas x 1 shard) zero=2 cp=2 ring"),
    (["model.name=debug-moe", "parallel.ep=2"], 2, "dp=2 zero=0 ep=2"),
    (["parallel.cp=2", "parallel.cp_method=allgather"], 2, "dp=1 zero=0 cp=2 allgather"),
])
def test_the_start_line_states_the_layout(overrides, world, expected):
    layout = resolve_run(load_config(DEBUG_CONFIG, overrides), world, "cpu").layout
    assert layout.describe() == expected


LR = [1e-3 * (k + 1) / 10 for k in range(10)]
GRAD_NORM = [3.0 - 0.2 * k for k in range(10)]
BY_SOURCE = {4: {"web": 3.1, "code": 2.2}, 8: {"web": 2.9, "code": 2.0}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Ten logged steps of a pipeline run: started at step 0, resumed alike at 4, resumed at 7 cut otherwise;
    peak memory 3.0-3.1 GiB; transfers of 841 ms beside a 514 ms step."""
    run = tmp_path_factory.mktemp("run")
    lines = [{"event": "started", "step": 0, "world_size": 2, "layout": "dp=1 zero=0 pp=2 1f1b m=4"}]
    for k in range(10):
        step = k + 1
        if step == 5:
            lines.append({"event": "started", "step": 4, "world_size": 2, "layout": "dp=1 zero=0 pp=2 1f1b m=4"})
        if step == 8:
            lines.append({"event": "started", "step": 7, "world_size": 4, "layout": "dp=2 zero=0 pp=2 1f1b m=2"})
        lines.append({"step": step, "loss": 4.0 - 0.1 * k, "lr": LR[k], "grad_norm": GRAD_NORM[k],
                      "tokens_per_sec": 1000.0, "step_time_s": 0.514, "mem_peak_bytes": int((3.0 + 0.01 * k) * 2**30),
                      "comm_send_recv_s": 0.841, "comm_time_s": 0.841})
        if step in BY_SOURCE:
            lines.append({"event": "eval", "step": step, "val_loss": sum(BY_SOURCE[step].values()) / 2,
                          "val_loss_by_source": BY_SOURCE[step]})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


@pytest.fixture(scope="module")
def figs(run_dir):
    import matplotlib.pyplot as plt

    made = figures(*load_records(run_dir))
    yield {name: fig.axes[0] for name, fig in made.items()}
    for fig in made.values():
        plt.close(fig)


def _line(ax, label):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def test_learning_rate_and_gradient_norm_are_plotted(figs):
    for name, values in (("lr.png", LR), ("grad_norm.png", GRAD_NORM)):
        data = [line for line in figs[name].get_lines() if not line.get_label().startswith(("resumed", "layout"))]
        assert len(data) == 1 and list(data[0].get_xdata()) == list(range(1, 11))
        assert list(data[0].get_ydata()) == values


def test_every_time_axis_marks_the_resume_and_the_layout_change(figs):
    for name in ("loss.png", "lr.png", "grad_norm.png", "throughput.png", "memory.png"):
        assert list(_line(figs[name], "resumed").get_xdata()) == [4, 4], name
        assert list(_line(figs[name], "layout: dp=2 zero=0 pp=2 1f1b m=2").get_xdata()) == [7, 7], name


def test_a_start_from_step_0_is_a_restart_and_one_from_a_checkpoint_a_resume():
    """A launcher restarting workers before the first checkpoint begins again at step 0: "restarted" (it used to be
    drawn as "resumed", which suggests state was loaded)."""
    start = {"event": "started", "world_size": 2, "layout": "dp=2 zero=0"}
    events = [{**start, "step": 0}, {**start, "step": 0}, {**start, "step": 6}, {**start, "step": 8, "layout": "dp=1"}]
    assert run_starts(events) == [(0, "restarted"), (6, "resumed"), (8, "layout: dp=1")]


def test_memory_starts_at_zero(figs):
    assert figs["memory.png"].get_ylim()[0] == 0


def test_validation_per_source(figs):
    for source in ("web", "code"):
        line = _line(figs["loss.png"], f"validation: {source}")
        assert list(line.get_xdata()) == [4, 8]
        assert list(line.get_ydata()) == [BY_SOURCE[4][source], BY_SOURCE[8][source]]


def test_pipeline_transfers_are_labelled_asynchronous(run_dir):
    rows = dict(summary(*load_records(run_dir)))
    assert rows["communication (median per step)"] == "send_recv (async, see note) 841.0 ms"
    assert "asynchronously beside compute, so their sum can exceed the step time" in rows["note"]
    assert rows["step time (median)"] == "0.514 s"


def test_several_runs_are_overlaid_one_line_each(run_dir, tmp_path):
    """`disttrain report A B`: each plot holds one line per run, named by its directory; the summary has each run's
    rows (the Quickstart suggests an lr variant to compare; report took one run only)."""
    from helpers import run_main

    other = tmp_path / "demo-lr1e-3"
    other.mkdir()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        if "loss" in line:
            line["loss"] -= 1.0
    (other / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, err = run_main("report", str(run_dir), str(other), "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    assert f"{run_dir.name}: loss  " in out and "demo-lr1e-3: loss  " in out
    import matplotlib.pyplot as plt

    from disttrain.observe.run_compare import overlay

    figs, rows = overlay([run_dir, other])
    for name in ("loss.png", "val_loss.png", "lr.png", "grad_norm.png", "throughput.png"):
        assert [line.get_label() for line in figs[name].axes[0].get_lines()] == [run_dir.name, "demo-lr1e-3"], name
    mine, theirs = (list(line.get_ydata()) for line in figs["loss.png"].axes[0].get_lines())
    assert mine == [4.0 - 0.1 * k for k in range(10)] and theirs == [4.0 - 0.1 * k - 1.0 for k in range(10)]
    assert (tmp_path / "cmp" / "loss.png").is_file() and "demo-lr1e-3" in (tmp_path / "cmp" / "index.html").read_text()
    plt.close("all")
