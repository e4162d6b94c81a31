"""The W&B logger, offline, read back from W&B's own run files with W&B's protobuf types."""

from rlx.testing.contracts import LoggerContract
from rlx_logger_wandb import read_offline_run


class TestWandbOffline(LoggerContract):
    logger_name = "wandb"
    args = {"mode": "offline", "project": "rlx-tests"}

    def read_back(self, output_dir):
        run = read_offline_run(output_dir)
        return run["config"], run["history"], run["tables"]
