"""A rank killed during a checkpoint save loses nothing (NOTE [checkpoint directories]): fresh ranks
resume from exactly the previous checkpoint, model and optimizer, whichever moment the kill came at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsdp_compile import latest_checkpoint, save_checkpoint
from fsdp_compile.examples.launch import RankFailure, run_ranks

from .crash_save_workers import crash_during_save, resume


@pytest.mark.parametrize("kill", ["writing", "before-open"])
def test_a_rank_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path: Path, kill: str) -> None:
    root = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure, match="rank 1 died of SIGKILL"):
        run_ranks(crash_during_save, 2, root, kill, timeout=180, pg_timeout_s=60)
    assert (tmp_path / "ckpt" / "step-000000002").is_dir()  # the crashed save left its directory
    results = run_ranks(resume, 2, root, timeout=180, pg_timeout_s=60)
    for r in results:
        assert r["checkpoint"] == "step-000000001" and r["step"] == 1, r
        assert r["same_params"] and r["same_optim"], r
        assert r["latest_after"] == "step-000000002", r
        assert r["dirs_after"] == ["step-000000001", "step-000000002"], r


def test_saves_without_a_crash_keep_the_newest(tmp_path: Path) -> None:
    """One process, no process group: ``keep`` newest complete checkpoints stay."""
    import torch

    for step in (1, 2, 3):
        save_checkpoint({"x": torch.full((3,), float(step))}, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000002", "step-000000003"]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.endswith("step-000000003")
    assert latest_checkpoint(tmp_path / "nothing-yet") is None
    for step in (4, 5):
        save_checkpoint({"x": torch.zeros(3)}, tmp_path, step, keep=5)  # fewer than keep: none is deleted
    assert len(list(tmp_path.glob("step-*"))) == 4


def test_step_directories_without_a_pointer_are_refused(tmp_path: Path) -> None:
    (tmp_path / "step-000000005").mkdir()
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        latest_checkpoint(tmp_path)
