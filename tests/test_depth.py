"""Pure-function tests of captionbert.depth (the notebook's own cells run under tests/test_notebooks.py)."""
import pytest
import torch

from captionbert.core import GuardError
from captionbert.depth import (BagOfWords, DepthConfig, binding_holds, binding_items, binding_probe, copied_positions, depth_gate,
                               place, probe_set, spectrum_depths, spectrum_ends, wilson95)


class _Tok:
    "A whitespace tokenizer with one id a word: enough for probe sets without the bundled WordPiece."
    cls_token_id, sep_token_id = 101, 102
    def __init__(self): self.vocab = {}
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault(w, 1000 + len(self.vocab)) for w in text.split()]}


def test_place_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="12 tokens .* longer than the model's capacity of 10"): place(list(range(12)), [5] * 50, 1, 10)
    with pytest.raises(ValueError, match="needs 34 positions but the model's capacity is 32"): place([1, 2, 3], [5] * 50, 30, 32)
    with pytest.raises(ValueError, match="filler holds 5 tokens but depth 9 needs 8"): place([1, 2, 3], [5] * 5, 9, 32)
    assert place([1, 2], [5, 6, 7], 3, 8) == [101, 5, 6, 1, 2, 102]


def test_copied_positions_tile_the_trained_rows():
    t = torch.arange(6.)[:, None]
    assert copied_positions(t, 3, 8)[:, 0].tolist() == [0, 1, 2, 1, 2, 1, 2, 1]


def test_bag_of_words_sits_exactly_at_chance():
    tok = _Tok()
    fit, held = binding_items(10, seed=5), binding_items(6, seed=6)
    filler = [7] * 40
    pf, ph = probe_set(tok, fit, filler, 4, 64), probe_set(tok, held, filler, 4, 64)
    bow = BagOfWords(torch.randn(3000, 16))
    r = binding_probe(bow(pf.batch.input_ids, pf.batch.attention_mask).last_hidden_state, pf,
                      bow(ph.batch.input_ids, ph.batch.attention_mask).last_hidden_state, ph)
    assert (r["object_to_attribute"], r["attribute_to_object"], r["verdict"]) == (0.5, 0.5, "fails")


def test_depth_claims_need_a_spectrum():
    with pytest.raises(GuardError, match="at least 8 depths"): spectrum_depths(512, 14, 3)
    rows = [{"depth": d, "binding": 0.9, "object_to_attribute": 0.9, "attribute_to_object": 0.9, "similarity": 0.9} for d in range(8)]
    with pytest.raises(GuardError, match="semantic gauge"): spectrum_ends([{"depth": r["depth"], "similarity": 1.0} for r in rows])
    assert depth_gate(rows, 7)["passed"]
    with pytest.raises(GuardError, match="reaches depth 7 but the gate covers through 9"): depth_gate(rows, 9)


def _spectrum(o2a, a2o, n=8):
    return [{"depth": 2 + 10 * d, "binding": (o2a + a2o) / 2, "object_to_attribute": o2a, "attribute_to_object": a2o, "similarity": 0.9}
            for d in range(n)]


def test_no_binding_at_the_shallow_depth_is_void_not_none():
    e = spectrum_ends(_spectrum(0.49, 0.55))
    assert (e["binding_ends"], e["similarity_flatters"]) == ("void", None)
    assert spectrum_ends(_spectrum(0.9, 0.9))["binding_ends"] is None        # binding held everywhere: it does not end


def test_binding_holds_is_both_directions_everywhere():
    rows = _spectrum(0.97, 0.55)                                            # mean 0.76 >= 0.75, one direction at chance
    assert not binding_holds(rows[0])
    assert depth_gate(rows, rows[-1]["depth"])["void"]
    assert spectrum_ends(rows)["binding_ends"] == "void"


def test_the_gate_is_taken_of_the_stock_shallow_read():
    stock, damaged = _spectrum(0.95, 0.95), _spectrum(0.6, 0.6)
    g = depth_gate(damaged, damaged[-1]["depth"], reference=stock[0])
    assert g["void"] is False and g["shallow"] == 0.95 and not g["passed"]


def test_wilson_interval():
    lo, hi = wilson95(0.5, 100)
    assert abs(lo - 0.4038) < 1e-3 and abs(hi - 0.5962) < 1e-3


def test_published_trunk_is_the_v2_run_checked_against_the_plan(tmp_path):
    from captionbert.amoe import backbone_runs, resolve_backbones
    cfg = DepthConfig.published()
    assert backbone_runs(cfg, root=tmp_path)[cfg.backbone_preset].name == "05_train-v2-seed0"
    with pytest.raises(GuardError, match="05_train-v2-seed0 holds no finished 05_train run"): resolve_backbones(cfg, root=tmp_path)


def test_probe_sets_read_their_own_attribute_kind():
    tok, filler = _Tok(), [7] * 40
    fit, held = binding_items(10, seed=5, kind="material"), binding_items(6, seed=6, kind="material")
    pf, ph = probe_set(tok, fit, filler, 4, 64), probe_set(tok, held, filler, 4, 64)
    assert pf.kind == "material"
    bow = BagOfWords(torch.randn(3000, 16))
    r = binding_probe(bow(pf.batch.input_ids).last_hidden_state, pf, bow(ph.batch.input_ids).last_hidden_state, ph)
    assert (r["object_to_attribute"], r["attribute_to_object"]) == (0.5, 0.5)
    with pytest.raises(ValueError, match="one attribute kind"): probe_set(tok, fit[:2] + binding_items(2, seed=7), filler, 4, 64)
