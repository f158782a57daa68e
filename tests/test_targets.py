"""Nothing lost, nothing clobbered (issue 24): a run directory that declares its targets refuses another roster before
anything is built and never rebuilds the targets it trained on; the run lock is taken before the targets are resolved;
a caption file too small for the preset is refused before any teacher runs; a killed embedder's temporaries are removed
at the next merge; a trunk's targets are found as a build beside it. Each test says what the code before it did.

The runs here train on tiny targets (400 captions of the scene grammar, the offline roster), so no test embeds the
smoke preset's 16,000 captions."""
import dataclasses, hashlib, json, os, re, subprocess, sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _tree(folder) -> str:
    "One hash of what a targets folder holds: where its alias points, and every file under the folder it names (name and bytes)."
    folder, h = Path(folder), hashlib.sha256()
    if folder.is_symlink(): h.update(os.readlink(folder).encode())
    real = folder.resolve()
    for p in sorted(real.rglob("*")):
        if p.is_file() and p.name != ".lock": h.update(str(p.relative_to(real)).encode() + p.read_bytes())
    return h.hexdigest()


def _spy(monkeypatch, module, name, calls):
    "Make module.name record its call and refuse to run (a teacher pass or a build that must not happen)."
    def refuse(*a, **k):
        calls.append(name); raise AssertionError(f"{name} was called")
    monkeypatch.setattr(module, name, refuse)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    "The module's own cache (embeddings, token stores): nothing here reads or fills the checkout's."
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("cache"); mp.setenv("CAPTIONBERT_CACHE", str(d))
        torch.set_num_threads(1)
        yield d


@pytest.fixture(scope="module")
def captions(tmp_path_factory):
    from captionbert.sources import SceneGrammar
    cap = tmp_path_factory.mktemp("captions") / "captions.txt"
    cap.write_text("\n".join(SceneGrammar(n=400, seed=3)[i] for i in range(400)) + "\n")
    return cap


def _tiny(captions):
    from captionbert.alignment import AlignmentConfig
    return AlignmentConfig(name="tiny", captions=str(captions), fit_n_over_d=0.6, eval_rows=64, shard_size=100)


TRAIN = dict(eval_rows=64, batch_size=16, max_steps=2, warmup_steps=1, eval_every=2, ckpt_every_steps=2, log_every=1)


@pytest.fixture(scope="module")
def declared(cache, captions, tmp_path_factory):
    "A completed run whose own targets (`<run>/targets`, the tiny set) it declared: config.json names their build, frame and fingerprint."
    from captionbert.consensus import build_consensus
    from captionbert.loop import TrainConfig
    from captionbert.train import run_consensus_training
    run = tmp_path_factory.mktemp("declared") / "run"
    build_consensus(_tiny(captions), run / "targets", device="cpu", progress=False)
    job = run_consensus_training(0, "smoke", run, str(run / "targets"), device="cpu", progress=False, train_config=TrainConfig.smoke(**TRAIN))
    assert job.result.completed
    return run


def test_a_declared_run_refuses_another_roster_before_anything_is_built(declared, monkeypatch):
    """Issue 24 case 1: the same call with roster="offline-mixed" on a run that declared the preset's roster is refused naming
    the difference, before a teacher runs, and the run's targets are byte for byte what they were. The code before it read
    only the frame from config.json, rebuilt `<run>/targets` in place (targets.json unlinked, then a teacher pass — the spy
    below stops it there) and would have refused on the frame only afterwards: this test failed on the spy and the hash."""
    from captionbert import consensus as C
    from captionbert.core import GuardError
    from captionbert.loop import TrainConfig
    from captionbert.train import run_consensus_training
    before, metrics, calls = _tree(declared / "targets"), (declared / "metrics.jsonl").read_bytes(), []
    _spy(monkeypatch, C, "embed_cached", calls); _spy(monkeypatch, C, "_build_consensus", calls)
    with pytest.raises(GuardError, match=r"holds a run of other targets than this call asks for: train\.roster: None -> 'offline-mixed'\. "
                                         r"Nothing was built"):
        run_consensus_training(0, "smoke", declared, "build", roster="offline-mixed", device="cpu", progress=False,
                               train_config=TrainConfig.smoke(**TRAIN))
    assert calls == [] and _tree(declared / "targets") == before and (declared / "metrics.jsonl").read_bytes() == metrics


def test_a_completed_run_never_rebuilds_the_targets_it_trained_on(declared, monkeypatch):
    """`build` on a completed run reads the build its config names (found by fingerprint) and rebuilds nothing: the run is
    complete, so it says there is nothing left to train. The code before it called build_consensus on `<run>/targets`
    with the smoke preset's key, which differs from the key the folder was built with, so it unlinked targets.json and
    rebuilt the folder the run points to (stopped here by the spy: the test failed on it and on the hash)."""
    from captionbert import consensus as C
    from captionbert.loop import NothingToTrain, TrainConfig
    from captionbert.train import run_consensus_training
    before, calls = _tree(declared / "targets"), []
    _spy(monkeypatch, C, "embed_cached", calls); _spy(monkeypatch, C, "_build_consensus", calls)
    with pytest.raises(NothingToTrain, match="nothing left to train"):
        run_consensus_training(0, "smoke", declared, "build", device="cpu", progress=False, train_config=TrainConfig.smoke(**TRAIN))
    assert calls == [] and _tree(declared / "targets") == before


def test_a_held_run_directory_is_refused_before_its_targets_are_built(tmp_path, monkeypatch, cache):
    """A second process on a held run directory is refused, naming the holder, before any build starts in it. The code
    before it resolved (and built) the targets first and took the lock only inside the training loop: the build spy
    below was called, and the test failed on it."""
    from captionbert import consensus as C
    from captionbert.core import GuardError
    from captionbert.train import run_consensus_training
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", f"import time; from captionbert.core import RunDir; RunDir({str(run)!r}).hold(); "
                               "print('held', flush=True); time.sleep(120)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        calls = []
        _spy(monkeypatch, C, "build_consensus", calls)
        with pytest.raises(GuardError, match=f"is in use: pid {holder.pid} on host"):
            run_consensus_training(0, "smoke", run, "build", max_steps=2, device="cpu", progress=False)
        assert calls == [] and not (run / "targets").exists()
    finally:
        holder.kill(); holder.wait()


def test_a_caption_file_too_small_is_refused_before_any_teacher(tmp_path, monkeypatch, cache):
    """Issue 24 case 9: a one-line caption file at the smoke preset is refused naming the file and the preset, before any
    teacher is loaded. The code before it embedded the line with every teacher and failed in split_rows with "asked for
    2048 rows but only 1 are available", naming no file (here the embedding spy was called: the test failed on it)."""
    from captionbert import consensus as C, embed as E, teachers as T, train as TR
    from captionbert.core import GuardError
    from captionbert.train import run_consensus_training
    one = tmp_path / "one-caption.txt"; one.write_text("a brown dog runs along the beach\n")
    monkeypatch.setenv("CAPTIONBERT_CAPTIONS", str(one))
    calls = []
    _spy(monkeypatch, C, "embed_cached", calls)
    for mod in (T, E, TR): _spy(monkeypatch, mod, "load_teachers", calls)     # each module that binds it (embed and train import it by name)
    with pytest.raises(GuardError, match=rf"the caption source '{re.escape(str(one))}' holds 1 row, too few for the alignment preset 'smoke': it holds out "
                                         r"2,048 rows .* no teacher has run"):
        run_consensus_training(0, "smoke", tmp_path / "run", "build", max_steps=2, device="cpu", progress=False)
    assert calls == []


def test_a_killed_embedders_temporaries_are_removed_at_the_merge(tmp_path, cache):
    """Issue 24 (orphans): a temporary a killed writer left in an embedding store (a shard, the manifest) is removed by the
    next embedding pass under the store's lock; a live writer's stays. The code before it left them forever (the test
    failed on `dead` still existing)."""
    from captionbert.sources import SceneGrammar
    from captionbert.teachers import load_teachers, offline_teachers
    from captionbert.embed import embed_corpus
    groups, src = load_teachers(list(offline_teachers((6,), 6)), device="cpu"), [SceneGrammar(n=64, seed=5)[i] for i in range(64)]
    folder = tmp_path / "emb"
    embed_corpus(src, groups, folder, shard_size=32, progress=False)
    gone = subprocess.Popen([sys.executable, "-c", ""]); gone.wait()
    dead = [folder / "minilm-L6" / f".shard-00001.safetensors.{gone.pid}.a1b2c3.tmp", folder / f".manifest.json.{gone.pid}.d4e5f6.tmp"]
    live = folder / "receipts" / f".shard-00000.json.{os.getpid()}.g7h8i9.tmp"
    for p in [*dead, live]: p.write_bytes(b"half")
    with pytest.warns(UserWarning, match="removed 2 temporary file"):
        embed_corpus(src, groups, folder, shard_size=32, progress=False)   # every shard done: nothing embedded, the merge runs
    assert not any(p.exists() for p in dead) and live.exists()


def test_a_trunks_targets_are_found_as_a_build_beside_it(cache, captions, tmp_path):
    """09's trained_range reads the targets a trunk trained on from a build beside its run (`consensus-<label>-<frame>-<id>`),
    as when a trunk and its targets' build are copied without the alias. The reader before it looked for the plain
    `consensus-<label>` folder only: with this builder and that reader the test fails with "its targets ... are in none
    of" (and on the code before it, which built in place, at the unlink of the alias: it was a folder)."""
    import numpy as np
    from captionbert.consensus import build_consensus
    from captionbert.core import sha256_bytes
    from captionbert.data import load_tokenizer, token_store
    from captionbert.depth import trained_range
    from captionbert.loop import TrainConfig
    from captionbert.recipe import caption_source, run_rows
    tc = TrainConfig.smoke(**TRAIN)
    tg = build_consensus(_tiny(captions), tmp_path / f"consensus-{tc.alignment_config().label}", device="cpu", progress=False)
    (tmp_path / f"consensus-{tc.alignment_config().label}").unlink()            # the build alone beside the trunk
    store = token_store(caption_source(tg), load_tokenizer(), tc.max_tokens, progress=False)
    rows = run_rows(tc, len(store), 0, lengths=store.lengths).train
    trunk = tmp_path / "trunk"; trunk.mkdir()
    (trunk / "config.json").write_text(json.dumps({"train": dataclasses.asdict(tc), "seed": 0, "frame": tg.frame, "targets": str(tmp_path / "moved"),
                                                   "corpus": {"targets_fingerprint": tg.fingerprint, "source_fingerprint": tg.source_fingerprint,
                                                              "train_rows_sha256": sha256_bytes(rows.astype(np.int64).tobytes())}}))
    got = trained_range(trunk)
    assert got["targets"] == str(tg.folder) and got["trained"] == int(store.lengths[rows].max()), got


def test_hub_targets_in_another_layout_are_refused_with_what_they_hold(tmp_path, monkeypatch):
    "--targets hub:<dataset> whose download is not this workbook's layout: refused naming its files and candidate columns, before any training."
    from captionbert.core import GuardError
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq
    from captionbert.loop import TrainConfig
    from captionbert.recipe import resolve_targets
    pq.write_table(pa.table({"text": ["a dog"], "target_vec": [[0.5, 0.5]]}), tmp_path / "train-00000.parquet")
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, repo_type=None: asked.append((repo, repo_type)) or str(tmp_path))
    with pytest.raises(GuardError) as e:
        resolve_targets("hub:AbstractPhil/captionbert-8192-v2-consensus", TrainConfig.smoke(), tmp_path / "run", progress=False)
    assert asked == [("AbstractPhil/captionbert-8192-v2-consensus", "dataset")], asked
    assert "train-00000.parquet:target_vec" in str(e.value) and "no targets.json" in str(e.value), e.value
