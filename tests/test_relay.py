"""The relay study's declared protocols, offline and fast: the published corpus spec (WikiText-103's config) and its
held-out splits, held-out whole documents offline, the gate budget at every size, the verdicts against declared bands
(the control's planted passing input), the map's citability bars, and the weights hash that the toggle check reads."""
import copy

import numpy as np
import pytest
import torch

from captionbert.core import GuardError
from captionbert.pairs import FlickrImages
from captionbert.sources import open_captions
from captionbert.causal_lm import LMShape, document_ids, heldout_split
from captionbert.relay import (RelayConfig, RelayModel, check_teacher_ahead, gate_travel_needed, placement_reading, relay_verdict,
                               weights_fingerprint)
from captionbert.token_map import map_verdict


def test_published_corpus_spec_names_wikitext_103():
    src = open_captions(RelayConfig.preset("published").corpus_hub, resolver=lambda name, rev: "0" * 40)   # offline: no hub call
    assert (src.hub_name, src.config, src.column, src.split) == ("Salesforce/wikitext", "wikitext-103-raw-v1", "text", "train")
    assert src.describe()["config"] == "wikitext-103-raw-v1" and "#wikitext-103-raw-v1:" in src.spec


@pytest.mark.parametrize("size", RelayConfig.PRESETS)
def test_gate_budget_reaches_a_tenfold_change(size):
    cfg, need = RelayConfig.preset(size), gate_travel_needed(-3.0)
    assert cfg.gate_reach() >= need - 1e-9 and placement_reading(cfg.gate_reach(), need) == "testable"
    assert dict(cfg.train_config("distill").lr_scales).get("gate", 1.0) == cfg.gate_lr_scale()
    plain = RelayConfig.preset(size, gate_reach_ratio=None)
    from captionbert.loop import summed_lr
    assert plain.train_config("distill").lr_scales == () and plain.gate_lr_scale() == 1.0                    # no reach asked: the recipe's own lr
    assert plain.gate_reach() == pytest.approx(summed_lr(plain.train_config("distill")))
    alone = summed_lr(cfg.train_config("distill"))                                  # the recipe's own reach
    assert placement_reading(plain.gate_reach(), need).startswith("untested") == (alone < need)   # untested exactly where the recipe alone falls short
    assert (cfg.gate_lr_scale() == 1.0) == (alone >= need)                          # and no gate multiplier where it does not
    assert (alone >= need) == (size == "narrow")   # narrow's 800 steps at lr 1e-2 reach it alone; every other size needs the multiplier


def test_relay_control_passes_on_its_planted_input():
    """The relay control's planted passing input: per-row reads on which the plain-MLP control's relays are better on every gauge
    (10% less NLL, 20% less KL, cloze right 90% vs 70%), read through `relay_verdict`, the verdict the Run section prints, with
    the rows grouped into documents as the Run groups them. The control must read 'control better' on each: a verdict that can
    only crown aleph, or that reads perplexity and KL the wrong way up (higher is better), fails here. The same reads swapped
    crown aleph, and a model against itself is a tie, so the verdict is no constant."""
    rng = np.random.default_rng(1)
    n = rng.integers(5, 15, 300); nll = rng.gamma(4.0, 0.75, 300) * n
    right_good, right_bad, ones = (rng.random(300) < 0.9).astype(float), (rng.random(300) < 0.7).astype(float), np.ones(300)
    docs = np.repeat(np.arange(100), 3)                                               # three rows a document, as held-out articles
    control_better = {"perplexity": ((nll, n), (0.9 * nll, n)), "kl_to_teacher": ((nll, n), (0.8 * nll, n)),
                      "cloze": ((right_bad, ones), (right_good, ones))}                 # (aleph's reads, the control's reads)
    for gauge, (aleph, control) in control_better.items():
        assert relay_verdict(aleph, control, gauge, groups=docs)["verdict"] == "control better", gauge
        assert relay_verdict(control, aleph, gauge, groups=docs)["verdict"] == "aleph better", gauge
        assert relay_verdict(control, control, gauge, groups=docs)["verdict"] == "tie", gauge
    with pytest.raises(ValueError, match="unknown gauge"): relay_verdict((nll, n), (nll, n), "bleu")


WIKI = [" = Alpha = ", " a1 ", " = = History = = ", " a2 ", " = Beta = ", " b1 ", " b2 ", " b3 ", " = Gamma = ", " g1 "]


def test_heldout_split_holds_out_whole_articles():
    """A planted WikiText on which the old split (the final `heldout` rows, texts[-4:]) puts article Beta on both sides:
    heldout_split holds Beta out whole. Catches the old split and any split by row count that ignores documents (a section
    heading ' = = History = = ' read as a new article would also show here)."""
    docs, unit = document_ids(WIKI)
    assert unit == "article" and docs.tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    old_train, old_held = np.arange(len(WIKI) - 4), np.arange(len(WIKI) - 4, len(WIKI))
    assert set(docs[old_train]) & set(docs[old_held]) == {2}                            # the planted input: the old split straddles Beta
    train, held = heldout_split(docs, 4)
    assert not set(docs[train]) & set(docs[held])
    assert held.tolist() == list(range(4, 10)) and train.tolist() == list(range(4))
    with pytest.raises(ValueError, match="cannot hold out"): heldout_split(docs, 9)     # every document held out: nothing to train on


def test_heldout_split_holds_out_whole_flickr_images():
    """Flickr8k offline (the relay's CPU substrate): a caption's document is its image. Three images of five captions, 7 rows to
    hold out: the old split (the final 7 rows) cuts image b in two; heldout_split holds out b and c whole."""
    images = [im for im in ("a.jpg", "b.jpg", "c.jpg") for _ in range(5)]
    caps = [f"{im[0]} caption {j}" for im in ("a.jpg", "b.jpg", "c.jpg") for j in range(5)]
    table = FlickrImages(images, ["train"] * 15, caps, origin="planted")
    docs, unit = document_ids(caps, images=table)
    assert unit == "image" and docs.tolist() == images
    assert set(docs[:-7]) & set(docs[-7:]) == {"b.jpg"}                                  # the old split straddles image b
    train, held = heldout_split(docs, 7)
    assert set(docs[held]) == {"b.jpg", "c.jpg"} and set(docs[train]) == {"a.jpg"}
    assert document_ids(caps + ["a caption no image has"], images=table)[1] == "row"   # rows the table lacks: each its own document


def test_heldout_split_never_shares_a_document_at_random():
    """Random documents (lengths 1-9, possibly interleaved) and random held-out sizes: no document id is on both sides, at
    least `heldout` rows are held out, and no fewer whole documents would do (the split is the smallest that suffices)."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        docs = np.repeat(np.arange(30), rng.integers(1, 10, 30))
        if trial % 2: docs = docs[rng.permutation(len(docs))]                             # interleaved rows of documents
        h = int(rng.integers(1, len(docs) // 2))
        train, held = heldout_split(docs, h)
        assert not set(docs[train].tolist()) & set(docs[held].tolist())
        assert len(held) >= h and sorted(np.r_[train, held].tolist()) == list(range(len(docs)))
        first = min(docs[held].tolist(), key=lambda d: np.flatnonzero(docs == d)[0])     # the earliest held-out document
        assert len(held) - int((docs == first).sum()) < h                                   # without it, too few rows


def test_published_heldout_is_wikitext_validation_and_test():
    """At published size the held-out text is WikiText-103's validation and test splits, never its train split: a config whose
    held-out spec reads the split trained on, or that names none, is refused."""
    pub = RelayConfig.preset("published")
    held = [open_captions(s, resolver=lambda name, rev: "0" * 40) for s in pub.heldout_hub]   # offline: no hub call
    assert [(h.hub_name, h.config, h.split) for h in held] == [("Salesforce/wikitext", "wikitext-103-raw-v1", s) for s in ("validation", "test")]
    with pytest.raises(ValueError, match="reads the split the study trains on"):
        RelayConfig.preset("published", heldout_hub=("hub:Salesforce/wikitext#wikitext-103-raw-v1:text",))   # split omitted: train
    with pytest.raises(ValueError, match="needs heldout_hub"): RelayConfig.preset("published", heldout_hub=())


def test_map_not_citable_below_its_bars():
    good = {"top1": 0.6, "ceiling_same_tokenizer": 0.9, "floor_shuffled": 0.01, "pairs_test": 400}
    assert map_verdict(good)["citable"]
    assert not map_verdict({**good, "ceiling_same_tokenizer": 0.009, "floor_shuffled": 0.0})["citable"]   # the first review's cpu numbers
    assert not map_verdict({**good, "floor_shuffled": 0.1})["citable"]                                   # ceiling under 10x the floor


def test_teacher_margin():
    assert check_teacher_ahead(30.0, 40.0) == pytest.approx(0.25)
    with pytest.raises(GuardError, match="declared margin"): check_teacher_ahead(39.5, 40.0)


def test_toggle_check_sees_a_weight_the_probe_never_reads():
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(LMShape(hidden=16, layers=2, heads=2, kv_heads=1, ffn=32).qwen2_config(300))
    m = RelayModel(copy.deepcopy(lm), [0, 1], "aleph", 8)
    assert m.assert_toggle_exact() == 0.0 and weights_fingerprint(m.base) == weights_fingerprint(lm)
    with torch.no_grad(): m.base.model.embed_tokens.weight[200] += 1.0                  # the default probe reads ids 1..8 only
    with pytest.raises(GuardError, match="a base weight moved"): m.assert_toggle_exact()
