from helpers import REPO, cli_env, run_module


def test_comm_hooks_compress_within_their_precision():
    proc = run_module("disttrain.launch.agent", ["--standalone", "--nproc-per-node=2",
                                                 str(REPO / "tests" / "workers" / "ddp_hooks.py")],
                      env=cli_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0 and "HOOKS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
