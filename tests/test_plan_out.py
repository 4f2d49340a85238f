"""`plan --out` names the config file to write: a directory is refused in one line before the search."""

from __future__ import annotations

from helpers import run_cli


def test_plan_refuses_a_directory_for_its_written_config(tmp_path):
    proc = run_cli("plan", "--model", "7b", "--gpus", "16", "--gpu", "a100-80g", "--out", str(tmp_path), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"disttrain: error: --out={tmp_path} is a directory: give the "
                                                    f"config file to write (e.g. {tmp_path}/plan.yaml)")
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
