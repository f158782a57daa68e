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
