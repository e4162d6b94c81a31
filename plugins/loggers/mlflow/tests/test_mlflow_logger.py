"""The MLflow logger, to a file store beside the run, read back with MLflow's own client."""

from rlx.testing.contracts import LoggerContract
from rlx_logger_mlflow import read_run


class TestMlflowFileStore(LoggerContract):
    logger_name = "mlflow"

    def read_back(self, output_dir):
        run = read_run(output_dir)
        assert run["status"] == "FINISHED"
        return run["config"], run["history"], run["tables"]
