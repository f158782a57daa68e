"""The main job's path: papermill injects parameters into 05_train (so `-p seed 1` is not silently ignored)."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_papermill_parameters_reach_the_run(tmp_path):
    papermill = pytest.importorskip("papermill")
    run_dir = tmp_path / "run"
    papermill.execute_notebook(str(ROOT / "nbs" / "05_train.ipynb"), str(tmp_path / "out.ipynb"), cwd=str(ROOT / "nbs"),
                               parameters={"seed": 3, "preset": "smoke", "run_dir": str(run_dir), "targets": "build"},
                               kernel_name="python3", progress_bar=False)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["seed"] == 3 and cfg["preset"] == "smoke"
    assert (run_dir / "checkpoints" / "final.safetensors").exists() and (run_dir / "export" / "config.json").exists()
    student = json.loads((run_dir / "results" / "student.json").read_text())
    assert student["seed"] == 3 and set(student["scores"]) == {"stsb", "biosses"}


def test_run_refuses_targets_of_another_frame(tmp_path):
    "A run directory that declares a frame refuses targets from any other (law 17), before training a single step."
    import shutil
    from captionbert.core import GuardError
    from captionbert.train import run_consensus_training
    run_dir = tmp_path / "run"
    first = run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets="build", max_steps=4, progress=False)
    other = tmp_path / "refit-targets"
    shutil.copytree(first.targets.folder, other)
    man = json.loads((other / "targets.json").read_text())
    man["frame"] = "0" * 64                                   # as if the maps had been refit
    (other / "targets.json").write_text(json.dumps(man))
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(GuardError, match="another frame"):
        run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets=str(other), max_steps=8, progress=False)
    assert (run_dir / "metrics.jsonl").read_text() == before   # nothing was trained or logged
