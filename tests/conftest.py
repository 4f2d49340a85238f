import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import PARITY, train  # noqa: E402


@pytest.fixture(scope="session")
def debug_reference(tmp_path_factory):
    """One process, one micro-batch of 4: the plain single-device computation that every layout of the
    debug model at the PARITY setting must reproduce (shared by every test module)."""
    return train(tmp_path_factory.mktemp("ref") / "run", *PARITY, "train.micro_batch_size=4")
