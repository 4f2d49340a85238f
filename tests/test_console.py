"""What a newcomer reads on the console: command-line mistakes in one line with their fix, `estimate` on a config
with overrides, sizes of small models."""

from __future__ import annotations

from helpers import DEBUG_CONFIG, run_main


def test_an_override_without_equals_gets_the_fix():
    code, out, err = run_main("train", str(DEBUG_CONFIG), "train.steps", "5")
    assert code == 2 and len(err.splitlines()) == 1
    assert "unrecognized arguments: train.steps 5 (did you mean train.steps=5? overrides are key=value)" in err


def test_estimate_takes_overrides_and_names_small_sizes_in_millions():
    code, out, err = run_main("estimate", str(DEBUG_CONFIG), "model.name=debug-moe", "train.micro_batch_size=2")
    assert code == 0, err
    import torch

    from disttrain.config.load import load_config
    from disttrain.models.registry import model_spec
    from disttrain.models.spec import build_model, count_params

    built = count_params(build_model(model_spec(load_config(DEBUG_CONFIG, ["model.name=debug-moe"]).model),
                                     torch.device("cpu"), 0))
    lines = out.splitlines()
    assert lines[0].startswith(f"Model: debug-moe, {built:,} parameters ({built / 1e6:.2f} M; "), lines[0]
    assert lines[0].endswith(" M active: 8 experts, top-2, 1 shared)")
    assert lines[1].startswith("Layout: dp=1 zero=0 mbs=2 ")
