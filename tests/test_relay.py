"""The relay study's declared protocols, offline and fast: the published corpus spec (WikiText-103's config), the gate
budget at every size, the verdicts against declared bands (both ways), the map's citability bars, and the weights hash
that the toggle check reads."""
import copy

import numpy as np
import pytest
import torch

from captionbert.core import GuardError
from captionbert.data import open_captions
from captionbert.relay import (LMShape, RelayConfig, RelayModel, check_teacher_ahead, gate_travel_needed, map_verdict,
                               paired_verdict, placement_reading, weights_fingerprint)


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
    from captionbert.train import summed_lr
    assert plain.train_config("distill").lr_scales == () and plain.gate_lr_scale() == 1.0                    # no reach asked: the recipe's own lr
    assert plain.gate_reach() == pytest.approx(summed_lr(plain.train_config("distill")))
    assert placement_reading(plain.gate_reach(), need).startswith("untested")      # every size's recipe alone falls short


def test_paired_verdict_both_ways():
    rng = np.random.default_rng(1)
    n = rng.integers(5, 15, 300); nll = rng.gamma(4.0, 0.75, 300) * n
    assert paired_verdict((0.9 * nll, n), (nll, n), "perplexity")["verdict"] == "aleph better"
    assert paired_verdict((nll, n), (0.9 * nll, n), "perplexity")["verdict"] == "control better"
    assert paired_verdict((nll, n), (nll, n), "kl_to_teacher")["verdict"] == "tie"
    with pytest.raises(ValueError, match="unknown gauge"): paired_verdict((nll, n), (nll, n), "bleu")


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
