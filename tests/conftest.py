import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import PARITY, PARITY_FP32, train  # noqa: E402


@pytest.fixture(scope="session")
def debug_reference(tmp_path_factory):
    """One process, one micro-batch of 4, in fp64: the plain single-device computation that every layout of
    the debug model at the PARITY setting must reproduce to EXACT (shared by every test module)."""
    return train(tmp_path_factory.mktemp("ref") / "run", *PARITY, "train.micro_batch_size=4")


@pytest.fixture(scope="session")
def debug_reference_fp32(tmp_path_factory):
    """The same in fp32: the reference of the low-precision and compression tests (what users run)."""
    return train(tmp_path_factory.mktemp("ref32") / "run", *PARITY_FP32, "train.micro_batch_size=4")


# The longest modules first: with `make test`'s workers taking one module at a time, the suite ends on short
# modules instead of one worker running a long one while the others idle.
LONGEST_FIRST = ("test_object_storage", "test_hf", "test_quickstart", "test_model_parallel", "test_context_parallel",
                 "test_moe", "test_fault_tolerance", "test_planner_grid", "test_lora", "test_deepspeed",
                 "test_observability", "test_sharding", "test_dryrun", "test_optimizers", "test_loss",
                 "test_chat_data", "test_balance", "test_runtime", "test_user_models", "test_export", "test_demo",
                 "test_parity", "test_plan", "test_resume")


def pytest_collection_modifyitems(items):
    def rank(item):
        module = item.path.stem
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a module is kept
