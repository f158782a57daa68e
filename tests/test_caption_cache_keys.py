"""Hub caption specs pin a commit, and the teacher-embedding cache key moves with it — checked offline, the hub
resolver replaced by a stand-in (the library's default path, not an injected argument)."""
import pytest

import captionbert.sources as sources
from captionbert.sources import SceneGrammar, open_captions
from captionbert.teachers import roster
from captionbert.embed import embed_cache_key


@pytest.fixture
def hub_heads(monkeypatch):
    "What each revision of every dataset points at; the module's resolver reads it instead of the hub."
    heads, asked = {None: "a" * 40, "main": "a" * 40, "v2": "b" * 40}, []
    def fake(name, revision):
        asked.append((name, revision)); return heads.get(revision, revision)
    monkeypatch.setattr(sources, "resolve_hub_revision", fake)
    return heads, asked


def test_spec_grammar(hub_heads):
    h = open_captions("hub:org/caps@v2:text:validation", limit=3)
    assert (h.hub_name, h.revision, h.column, h.split) == ("org/caps", "v2", "text", "validation")
    assert hub_heads[1] == []                                  # parsing never asks the hub
    assert h.commit == "b" * 40 and hub_heads[1] == [("org/caps", "v2")]
    assert open_captions("hub:org/caps:text").split == "train"
    with pytest.raises(ValueError, match="hub captions are"): open_captions("hub:org/caps@:text")
    with pytest.raises(FileNotFoundError, match="synthetic_flickr.txt"): open_captions("synthetic_flickr.txt")
    assert isinstance(open_captions("synthetic:7"), SceneGrammar) and len(open_captions("synthetic:7")) == 7


def test_fingerprint_and_cache_key_follow_the_commit(hub_heads):
    heads, _ = hub_heads
    specs = roster("hub")
    def key(spec): return embed_cache_key(open_captions(spec, limit=100), specs, 100, 4096, "cuda", "bf16")
    k_main = key("hub:org/caps:text")
    assert key("hub:org/caps:text") == k_main                   # same spec, same commit: the cache is reused
    assert key("hub:org/caps@main:text") == k_main              # the branch named explicitly is the same commit
    assert key("hub:org/caps@" + "a" * 40 + ":text") == k_main  # and so is its sha
    assert key("hub:org/caps@v2:text") != k_main                # another revision: another cache
    heads[None] = heads["main"] = "c" * 40                      # the default branch moves on the hub
    assert key("hub:org/caps:text") != k_main


def _targets(src, record):
    "A ConsensusTargets as build_consensus leaves it, minus the vectors: the config's unpinned spec, and (or not) the captions record."
    import dataclasses
    from pathlib import Path
    import torch
    from captionbert.alignment import AlignmentConfig
    from captionbert.targets import ConsensusTargets
    cfg = AlignmentConfig(name="published", roster="hub", captions="hub:org/caps:text:validation", limit=50)
    man = {"config": dataclasses.asdict(cfg), "source_fingerprint": src.fingerprint, "frame": "f" * 64, "shards": {}}
    if record is not None: man["captions"] = record
    return ConsensusTargets(Path("built-targets"), None, man)   # caption_source reads the manifest only


def test_record_carries_the_commit_and_training_reopens_it(hub_heads):
    "The captions record names the commit resolved at build time; after the branch moves, training reads that commit, not the new head."
    from captionbert.core import GuardError
    from captionbert.recipe import caption_source
    heads, asked = hub_heads
    src = open_captions("hub:org/caps:text:validation", limit=50)
    rec = src.describe()
    assert {k: rec[k] for k in ("hub_name", "revision", "commit", "split", "column", "limit")} == \
        {"hub_name": "org/caps", "revision": None, "commit": "a" * 40, "split": "validation", "column": "text", "limit": 50}
    assert rec["spec"] == "hub:org/caps@" + "a" * 40 + ":text:validation" and rec["fingerprint"] == src.fingerprint
    assert "a" * 12 in src.name and "validation" in src.name and "a" * 12 in repr(src)   # name and repr say what was read
    heads[None] = heads["main"] = "c" * 40                        # the default branch moves after the targets were built
    again = caption_source(_targets(src, rec))
    assert again.commit == "a" * 40 and again.fingerprint == src.fingerprint
    assert asked[-1] == ("org/caps", "a" * 40)                   # reopened at the recorded commit, not the branch
    # targets from before the record: the unpinned spec re-resolves to the new head, and the advice is a pinned spec
    with pytest.raises(GuardError, match=r"hub:org/caps@<commit>:text:validation") as e:
        caption_source(_targets(src, None))
    assert "CAPTIONBERT_CAPTIONS" not in str(e.value)
