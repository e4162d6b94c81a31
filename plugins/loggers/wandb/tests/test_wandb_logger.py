"""The W&B logger, offline, read back from W&B's own run files with W&B's protobuf types."""

import pytest

from rlx.testing.contracts import LoggerContract
from rlx_logger_wandb import read_offline_run


@pytest.fixture(autouse=True)
def _wandb_service_ends_with_the_test():
    """W&B's service process lives as long as the process whose run started it: each test ends its own (rlx's
    test plugin kills what a test leaves running, and the next test would find the service gone)."""
    yield
    import wandb

    wandb.teardown()


class TestWandbOffline(LoggerContract):
    logger_name = "wandb"
    args = {"mode": "offline", "project": "rlx-tests"}

    def read_back(self, output_dir):
        run = read_offline_run(output_dir)
        return run["config"], run["history"], run["tables"]
