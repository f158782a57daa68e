"""Hub caption specs pin a commit, and the teacher-embedding cache key moves with it — checked offline, the hub
resolver replaced by a stand-in (the library's default path, not an injected argument)."""
import pytest

import captionbert.data as data
from captionbert.data import SceneGrammar, open_captions
from captionbert.teachers import embed_cache_key, roster


@pytest.fixture
def hub_heads(monkeypatch):
    "What each revision of every dataset points at; the module's resolver reads it instead of the hub."
    heads, asked = {None: "a" * 40, "main": "a" * 40, "v2": "b" * 40}, []
    def fake(name, revision):
        asked.append((name, revision)); return heads.get(revision, revision)
    monkeypatch.setattr(data, "resolve_hub_revision", fake)
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
