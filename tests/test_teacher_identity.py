"""Caches, stores and targets know their teachers by their weights (issue 23.4): two different teachers saved one after
the other at one path get two cache keys, and a store or targets made by the old one are refused against the new one,
naming the teacher and both identities. Each check fails on the code that named a teacher by its spec alone."""
import json
import shutil

import pytest
import torch

from captionbert.alignment import AlignmentConfig, RowEmbeddings, fit_roster
from captionbert.consensus import build_consensus, check_store, write_targets
from captionbert.targets import load_targets
from captionbert.core import GuardError
from captionbert.sources import open_captions
from captionbert.rehearsal import save_rehearsal_teacher
from captionbert.teachers import load_teachers, teacher_identities, teacher_identity
from captionbert.embed import EmbeddingStore, embed_cache_key, embed_corpus
from captionbert.train import teacher_cache_key


def _rewrite(folder, seed, width=64):
    "The rehearsal teacher at `folder`, written afresh at `seed` (the same path, other weights)."
    if folder.exists(): shutil.rmtree(folder)
    return save_rehearsal_teacher(folder, width=width, seed=seed)


def test_two_teachers_at_one_path_get_two_keys(tmp_path):
    "Spec-only keys gave seeds 0 and 1 one key (the spec, path included, is identical); the weights identity separates them."
    folder, src = tmp_path / "teacher", open_captions("synthetic:100")
    keys, ids, harness = {}, {}, {}
    sts = tmp_path / "sts"; sts.mkdir()
    (sts / "stsb.tsv").write_text("sentence1\tsentence2\tscore\n" + "".join(f"a dog {i}\ta cat {i}\t{i % 5}\n" for i in range(8)))
    for seed in (0, 1):
        specs = _rewrite(folder, seed, width=768)                    # the rehearsal teacher as 05b saves it
        keys[seed] = embed_cache_key(src, specs, None, 4096, "cpu", "fp32")
        ids[seed] = teacher_identity(specs[0])
        harness[seed] = teacher_cache_key(specs, ["stsb"], sts, "cpu", "fp32")
    print(f"embed_cache_key at one path: seed 0 {keys[0]}, seed 1 {keys[1]}")
    assert specs[0].source == str(folder)
    assert keys[0] != keys[1] and ids[0] != ids[1] and harness[0] != harness[1]
    again = _rewrite(tmp_path / "elsewhere", 1, width=768)              # the same weights at another path: the same teacher
    assert teacher_identity(again[0]) == ids[1]


def test_a_changed_teacher_is_refused_by_its_store_and_its_targets(tmp_path):
    "A store and targets made by the seed-0 teacher, checked after seed 1 was saved at its path: each refusal names the teacher and both identities."
    folder, rows = tmp_path / "teacher", 96
    src = open_captions(f"synthetic:{rows}")
    specs = _rewrite(folder, 0)
    store = embed_corpus(src, load_teachers(specs, device="cpu"), tmp_path / "emb", shard_size=32, progress=False)
    old = teacher_identities(specs)
    assert store.manifest["weights"] == old
    assert check_store(store, src, specs) is store                        # the teacher that made it: accepted
    emb = {t: RowEmbeddings.load(store, t) for t in store.teachers}
    targets = write_targets(store, fit_roster(emb, "tiny-L2", range(0, rows, 2)), tmp_path / "targets", progress=False)
    assert json.loads((targets / "targets.json").read_text())["weights"] == old
    assert load_targets(targets).n_rows == rows

    _rewrite(folder, 1)                                                   # another teacher at the same path, same spec
    new = teacher_identities(specs)
    assert new != old
    for name in ("tiny-L1", "tiny-L2"):
        want = f"teacher {name}: recorded {old[name][:23]}, now {new[name][:23]}"
        with pytest.raises(GuardError, match="was made by other teachers") as e: check_store(store, src, specs)
        assert want in str(e.value)
        with pytest.raises(GuardError, match=f"the targets folder {targets} was made by other teachers") as e: load_targets(targets)
        assert want in str(e.value)
    # the consensus stage refuses the stale store before it fits or writes anything
    cfg = AlignmentConfig(name="t", captions=f"synthetic:{rows}", fit_n_over_d=0.5, eval_rows=16, shard_size=32)
    out = tmp_path / "built"
    with pytest.raises(GuardError, match="teacher tiny-L1: recorded"):
        build_consensus(cfg, out, device="cpu", progress=False, embeddings=store.folder, specs=specs)
    assert not out.exists()
    # the new teacher's vectors differ, so a store it makes is another store (resuming into the old one is refused)
    with pytest.raises(GuardError, match="already holds embeddings of other teachers: teacher tiny-L1"):
        embed_corpus(src, load_teachers(specs, device="cpu"), tmp_path / "emb", shard_size=32, progress=False)
    fresh = embed_corpus(src, load_teachers(specs, device="cpu"), tmp_path / "emb2", shard_size=32, progress=False)
    assert check_store(fresh, src, specs) is fresh
    assert not torch.allclose(fresh.load("tiny-L2"), EmbeddingStore(tmp_path / "emb").load("tiny-L2"))


def test_a_pinned_revision_reaches_from_pretrained(monkeypatch):
    "The hub roster's pinned commit is what transformers is asked for. Catches: load_source (or TeacherGroup) dropping `revision=`, so the pin names the weights in every key but the hub's HEAD is what loads."
    import transformers
    from captionbert.teachers import HUB_TEACHERS, TeacherGroup
    asked = []
    class Stop(Exception): pass
    def spy(kind):
        def from_pretrained(source, *args, **kwargs):
            asked.append((kind, source, kwargs.get("revision")))
            if kind == "model": raise Stop()
            return object()
        return from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy("tokenizer"))
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", spy("model"))
    spec = HUB_TEACHERS[0]
    with pytest.raises(Stop): TeacherGroup([spec])
    assert asked == [("tokenizer", spec.source, spec.revision), ("model", spec.source, spec.revision)], asked
    assert spec.revision is not None and len(spec.revision) == 40
