"""Checkpoints: complete or absent, found without a pointer, pruned per run, and a full disk said plainly."""

import errno
import json
import shutil
from collections import namedtuple

import pytest

from rlx.errors import RLXError
from rlx.orchestrate import checkpoint


class FakeTrainer:
    def __init__(self, fail: BaseException | None = None):
        self.fail = fail

    def save(self, folder, background=False):
        (folder / "model.pt").write_bytes(b"weights")
        if self.fail is not None:
            raise self.fail


def save(root, step, run_id, trainer=None, keep=2):
    return checkpoint.save(root, step, trainer or FakeTrainer(), {"cursor": step}, {"version": step, "run_id": run_id},
                           keep=keep)


def test_a_checkpoint_is_complete_marked_and_found_without_the_pointer(tmp_path):
    folder = save(tmp_path, 3, "a")
    assert sorted(p.name for p in folder.iterdir()) == ["COMPLETE", "meta.json", "model.pt", "rollout.json"]
    (tmp_path / "latest").unlink()  # the pointer is for people: resuming reads the folders
    found, rollout, meta = checkpoint.load_latest(tmp_path)
    assert found == folder and rollout == {"cursor": 3} and meta["run_id"] == "a" and meta["version"] == 3
    # a folder without the marker (renamed by hand, or from a crash of the whole machine) is not a checkpoint
    shutil.copytree(folder, tmp_path / "step_9")
    (tmp_path / "step_9" / "COMPLETE").unlink()
    assert checkpoint.load_latest(tmp_path)[0] == folder


def test_a_failed_save_leaves_nothing_and_the_next_removes_a_killed_ones_leftovers(tmp_path):
    good = save(tmp_path, 1, "a")
    with pytest.raises(ValueError):
        save(tmp_path, 2, "a", FakeTrainer(ValueError("trainer broke")))
    assert not (tmp_path / ".step_2.tmp").exists() and not (tmp_path / "step_2").exists()
    (tmp_path / ".step_3.tmp").mkdir()  # a save killed with SIGKILL
    (tmp_path / ".step_3.tmp" / "model.pt").write_bytes(b"half")
    assert checkpoint.load_latest(tmp_path)[0] == good
    save(tmp_path, 4, "a")
    assert not (tmp_path / ".step_3.tmp").exists()


def test_pruning_keeps_to_this_runs_checkpoints_and_resume_takes_the_newest_saved(tmp_path):
    for step in (40, 60):
        save(tmp_path, step, "old")
    save(tmp_path, 20, "new")  # a new run in the old run's folder: its step 20 is not pruned for old 40 and 60
    assert {p.name for p in tmp_path.glob("step_*")} == {"step_20", "step_40", "step_60"}
    assert checkpoint.load_latest(tmp_path)[2]["run_id"] == "new"
    save(tmp_path, 30, "new")
    save(tmp_path, 35, "new")  # keep 2 of the new run's: 20 goes, the old run's stay
    assert {p.name for p in tmp_path.glob("step_*")} == {"step_30", "step_35", "step_40", "step_60"}
    assert checkpoint.load_latest(tmp_path)[0].name == "step_35"


def test_a_full_disk_is_named_with_the_path_and_nothing_is_left(tmp_path, monkeypatch):
    save(tmp_path, 1, "a")
    with pytest.raises(RLXError, match=r"no space left on .* \(mounted at /.*\) writing checkpoint .*\.step_2\.tmp"):
        save(tmp_path, 2, "a", FakeTrainer(OSError(errno.ENOSPC, "No space left on device")))
    assert not (tmp_path / ".step_2.tmp").exists()
    # torch's zip writer hides the errno: a write failure on a filesystem that is now full counts too
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(100, 100, 0))
    with pytest.raises(RLXError, match="no space left"):
        save(tmp_path, 3, "a", FakeTrainer(RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter "
                                                        "failed writing file data/0: file write failed")))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(100, 0, 100 << 30))
    with pytest.raises(RuntimeError, match="file write failed"):  # with room to spare, it is not a full disk
        save(tmp_path, 3, "a", FakeTrainer(RuntimeError("file write failed")))
    assert json.loads((checkpoint.load_latest(tmp_path)[0] / "meta.json").read_text())["step"] == 1


def test_resume_without_a_complete_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(RLXError, match="no complete checkpoint under"):
        checkpoint.load_latest(tmp_path / "checkpoints")
