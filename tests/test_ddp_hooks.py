import subprocess
import sys

from helpers import REPO, cli_env


def test_comm_hooks_compress_within_their_precision():
    proc = subprocess.run([sys.executable, "-m", "disttrain.launch.agent", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "workers" / "ddp_hooks.py")],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "HOOKS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
