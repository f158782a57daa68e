"""Pure-function tests of captionbert.depth (the notebook's own cells run under tests/test_notebooks.py)."""
import pytest
import torch

from captionbert.core import GuardError
from captionbert.depth import (BagOfWords, binding_items, binding_probe, copied_positions, depth_gate, place, probe_set,
                               spectrum_depths, spectrum_ends)


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
    rows = [{"depth": d, "binding": 0.9, "similarity": 0.9} for d in range(8)]
    with pytest.raises(GuardError, match="semantic gauge"): spectrum_ends([{"depth": r["depth"], "similarity": 1.0} for r in rows])
    assert depth_gate(rows, 7)["passed"]
    with pytest.raises(GuardError, match="reaches depth 7 but the gate covers through 9"): depth_gate(rows, 9)
