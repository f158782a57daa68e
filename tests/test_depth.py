"""Pure-function tests of captionbert.arm, captionbert.binding and captionbert.depth (the notebooks' own cells run under tests/test_notebooks.py)."""
import pytest
import torch

from captionbert.core import GuardError
from captionbert.arm import copied_positions, copied_rows, model_capacity, seam_positions
from captionbert.binding import (BagOfWords, above_chance, band_read, binding_holds, binding_items, binding_probe, place, probe_set, spectrum_depths,
                                 spectrum_ends)
from captionbert.depth import DepthConfig, depth_gate, position_reach, trained_range


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
    with pytest.raises(GuardError, match="at least 8 depths"): spectrum_depths({"trunk": 512}, 14, 3, trained=40)
    rows = [{"depth": d, "binding": 0.9, "object_to_attribute": 0.9, "attribute_to_object": 0.9, "similarity": 0.9, "similarity_floor": 0.3}
            for d in range(8)]
    ref = band_read(rows, [0, 1])
    with pytest.raises(GuardError, match="semantic gauge"): spectrum_ends([{"depth": r["depth"], "similarity": 1.0} for r in rows], ref)
    assert depth_gate(rows, 7, ref)["passed"]
    with pytest.raises(GuardError, match="reaches depth 7 but the gate covers through 9"): depth_gate(rows, 9, ref)


def _spectrum(o2a, a2o, n=8):
    return [{"depth": 2 + 10 * d, "binding": (o2a + a2o) / 2, "object_to_attribute": o2a, "attribute_to_object": a2o, "similarity": 0.9,
             "similarity_floor": 0.3} for d in range(n)]


def test_no_binding_at_the_shallow_depth_is_void_not_none():
    rows = _spectrum(0.49, 0.55)
    e = spectrum_ends(rows, band_read(rows, [2, 12]))
    assert (e["binding_ends"], e["similarity_flatters"]) == ("void", None)
    held = _spectrum(0.9, 0.9)
    assert spectrum_ends(held, band_read(held, [2, 12]))["binding_ends"] is None        # binding held everywhere: it does not end


def test_binding_holds_is_both_directions_everywhere():
    rows = _spectrum(0.97, 0.55)                                            # mean 0.76 >= 0.75, one direction at chance
    assert not binding_holds(rows[0])
    assert depth_gate(rows, rows[-1]["depth"], band_read(rows, [2, 12]))["void"]
    assert spectrum_ends(rows, band_read(rows, [2, 12]))["binding_ends"] == "void"


def test_the_gate_is_taken_of_the_stock_shallow_read():
    stock, damaged = _spectrum(0.95, 0.95), _spectrum(0.6, 0.6)
    g = depth_gate(damaged, damaged[-1]["depth"], band_read(stock, [2, 12]))
    assert g["void"] is False and g["shallow"] == 0.95 and not g["passed"]


def test_the_gate_judges_both_directions_not_their_mean():
    "Issue 23's planted case: band .9 / .9, every read object->attribute 1.0, attribute->object .66; the mean .83 clears the needed .82, so a gate on the mean passes (the old depth_gate did), while binding_holds says it does not hold one way."
    band = {"depth": (2, 12), "object_to_attribute": .9, "attribute_to_object": .9, "binding": .9}
    for o2a, a2o in ((1.0, .66), (.66, 1.0)):
        rows = _spectrum(o2a, a2o)
        g = depth_gate(rows, rows[-1]["depth"], band)
        assert rows[0]["binding"] >= .5 + .8 * (.9 - .5)                                    # the mean would pass
        assert not binding_holds(rows[0], g["needed"]) and not binding_holds(rows[0])
        assert g["passed"] is False and not g["void"] and not any(p["passed"] for p in g["depths"]), g
        assert spectrum_ends(rows, band)["binding_ends"] == 2                               # binding ends at the band's first depth, not "never"
    assert depth_gate(_spectrum(.9, .85), 72, band)["passed"] is True                      # both directions above their bars


def test_every_interval_counts_items():
    "Items whose eight reads agree (half bound, half crossed): the interval is the items', ~2.8x a Wilson interval over reads. Catches wilson95(binding, 2 * n)."
    from captionbert.stats import wilson95
    tok, filler = _Tok(), [7] * 40
    fit, held = binding_items(30, seed=5), binding_items(24, seed=6)
    pf, ph = probe_set(tok, fit, filler, 4, 64), probe_set(tok, held, filler, 4, 64)
    def planted(ps, crossed_from):
        s = torch.randn(len(ps), ps.batch.input_ids.shape[1], 48, generator=torch.Generator().manual_seed(len(ps))) * .3
        for r in range(len(ps)):
            k = int(r >= crossed_from)
            for o in range(2):
                s[r, ps.noun_pos[r, o], int(ps.attr[r, o ^ k])] += 3; s[r, ps.attr_pos[r, o], 20 + int(ps.noun[r, o ^ k])] += 3
        return s
    r = binding_probe(planted(pf, len(pf)), pf, planted(ph, len(ph) // 2), ph)
    (lo, hi), (wlo, whi) = r["ci95"], wilson95(.5, 8 * 24)
    assert r["binding"] == .5 and lo < .5 < hi and (hi - lo) > 2.2 * (whi - wlo), (r["ci95"], (wlo, whi))
    assert r["n_items"] == 24
    rows = [{"depth": d, **{k: r[k] for k in ("binding", "object_to_attribute", "attribute_to_object", "items", "per_item", "n_read")}} for d in (4, 9)]
    ref = band_read(rows, [4, 9])
    assert ref["n_items"] == 24 and ref["ci95"] == pytest.approx(r["ci95"])                # the same items at two depths: still 24 units


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


def test_depths_fit_every_model_and_name_the_one_that_limits():
    plan = spectrum_depths({"trunk": 512, "teacher": 200, "arm": 512}, 15, 10, trained=42)
    assert (plan.capacity, plan.limited_by) == (200, "teacher") and max(plan.depths) == 200 - 15 - 1
    with pytest.raises(ValueError, match="teacher holds 40 positions"): spectrum_depths({"trunk": 512, "teacher": 40}, 15, 10, trained=42)


def test_seams_are_where_the_copied_table_restarts_and_are_read_with_a_point_past():
    rows = copied_rows(42, 512)
    seams = seam_positions(42, 512)
    assert seams[0] == 42 and all(int(rows[s]) == 1 and int(rows[s - 1]) == 41 for s in seams)      # each restarts the tiling at row 1
    assert seams == list(range(42, 512, 41))
    t = torch.randn(512, 4)
    assert torch.equal(copied_positions(t, 42, 512)[seams], t[[1] * len(seams)])                     # the same rule as the copied table
    plan = spectrum_depths({"arm": 512}, 15, 10, trained=42, seams=12)
    assert set(plan.all_seams) <= set(plan.depths) and {s + 1 for s in plan.all_seams} <= set(plan.depths)
    assert all(s + 1 <= max(plan.depths) for s in plan.all_seams)


def test_the_reference_is_a_shallow_band_inside_the_trained_range():
    plan = spectrum_depths({"arm": 512}, 15, 10, trained=42, band=4)
    assert len(plan.band) == 4 and plan.band[0] == 9 and plan.band[-1] + 15 == 42 - 1                    # 8 tokens of context first; the deepest [SEP] at 41
    assert plan.spread[0] == 1                                                                            # depth 1 (no context) is still read
    with pytest.raises(GuardError, match="never one point"): spectrum_depths({"arm": 512}, 15, 10, trained=42, band=1)
    rows = [{"depth": d, "binding": b, "object_to_attribute": b, "attribute_to_object": b, "n_read": 10} for d, b in ((1, .9), (9, .8), (17, .85), (26, .85))]
    ref = band_read(rows, [1, 9, 17, 26])
    assert ref["binding"] == pytest.approx(.85) and ref["n_read"] == 40
    with pytest.raises(GuardError, match="never one point"): band_read(rows, [1])


def test_the_gate_compares_binding_above_chance():
    band = {"object_to_attribute": .8, "attribute_to_object": .8, "binding": .8}
    rows = [{"depth": d, "binding": b, "object_to_attribute": b, "attribute_to_object": b} for d, b in ((1, .8), (50, .66), (100, .75))]
    g = depth_gate(rows, 100, band)
    assert [p["passed"] for p in g["depths"]] == [True, False, True]          # .66 / .8 = .83 would pass a raw 0.8 ratio; above chance it keeps .53
    assert g["depths"][1]["above_chance"] == pytest.approx(.16 / .3) and g["needed"] == pytest.approx({"object_to_attribute": .74, "attribute_to_object": .74})
    assert above_chance(.5, .9) == 0.0
    with pytest.raises(ValueError, match="not above chance"): above_chance(.6, .5)


def test_capacity_is_read_from_the_model_object():
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel
    from captionbert.encoder import CaptionEncoder, EncoderConfig
    assert model_capacity(CaptionEncoder(EncoderConfig.tiny(max_positions=100))) == 100
    small = dict(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    assert model_capacity(BertModel(BertConfig(max_position_embeddings=77, **small))) == 77
    assert model_capacity(RobertaModel(RobertaConfig(max_position_embeddings=66, pad_token_id=1, **small))) == 64   # rows 0-1 are below the pad
    with pytest.raises(TypeError, match="cannot read how many positions"): model_capacity(BagOfWords(torch.randn(10, 4)))


def test_trained_range_is_measured_on_the_training_rows(tmp_path):
    reach = position_reach([5, 9, 42, 7, 30], rows=[0, 1, 3, 4])              # row 2 (42 tokens) was never trained on
    assert (reach["trained"], reach["rows"]) == (30, 4)
    assert DepthConfig.cpu().trained is None and DepthConfig.published().trained is None     # measured, not declared
    import dataclasses, json
    from captionbert.loop import TrainConfig
    (tmp_path / "config.json").write_text(json.dumps({"train": dataclasses.asdict(TrainConfig.cpu()), "frame": "f", "seed": 0, "targets": str(tmp_path / "gone"),
                                                      "corpus": {"targets_fingerprint": "0123456789abcdef", "train_rows_sha256": "x"}}))
    with pytest.raises(GuardError, match="its targets 0123456789ab are in none of"): trained_range(tmp_path, targets=tmp_path / "gone")


def _tiny_bert(seed=0, positions=64, vocab=3000):
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    return BertModel(BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                max_position_embeddings=positions)).eval()


def test_the_arm_sits_on_a_bert_trunk_through_hooks_and_disengages_exactly():
    from captionbert.arm import DepthArm, DepthModel
    bert, long = _tiny_bert(), torch.randint(1000, 2000, (2, 40))
    arm = DepthArm(bert, trained=16, length=64, rank=4)
    dm = DepthModel(bert, arm)
    with torch.no_grad():
        stock = bert(long).last_hidden_state
        assert torch.equal(dm(long[:, :16]).last_hidden_state, bert(long[:, :16]).last_hidden_state)   # born equal inside the trained range
        assert not torch.equal(dm(long).last_hidden_state, stock)                                       # the copied rows are read beyond it
        dm.engaged = False
        assert torch.equal(dm(long).last_hidden_state, stock)                                           # disengaged: stock, bit for bit
        dm.engaged = True
        arm.adapters.up[1].weight.normal_()                                                             # the hook writes after block 1
        assert not torch.equal(dm(long[:, :16]).last_hidden_state, bert(long[:, :16]).last_hidden_state)
        assert torch.equal(bert(long).last_hidden_state, stock)                                         # no hook left behind on the trunk
    with pytest.raises(ValueError, match="41 tokens but the depth arm extends the trunk to 40"):
        DepthModel(bert, DepthArm(bert, 16, 40))(torch.randint(1000, 2000, (1, 41)))


def test_the_guard_refuses_arms_across_trunk_kinds():
    from captionbert.arm import DepthArm, DepthModel
    from captionbert.encoder import CaptionEncoder, EncoderConfig
    bert, enc = _tiny_bert(), CaptionEncoder(EncoderConfig.tiny()).eval()
    with pytest.raises(GuardError, match="backbone-bound"): DepthModel(enc, DepthArm(bert, 16, 64))
    with pytest.raises(GuardError, match="backbone-bound"): DepthModel(bert, DepthArm(enc, 16, 64))
    with pytest.raises(GuardError, match="backbone-bound"): DepthModel(_tiny_bert(seed=1), DepthArm(bert, 16, 64))


def test_the_standin_is_minilm_cut_at_its_trained_range():
    from transformers import AutoModel
    from captionbert.data import bundled_minilm_path
    from captionbert.arm import standin_trunk
    full, si = AutoModel.from_pretrained(str(bundled_minilm_path())).eval(), standin_trunk(20, seed=3)
    P, Pf = si.embeddings.position_embeddings.weight, full.embeddings.position_embeddings.weight
    assert torch.equal(P[:20], Pf[:20]) and torch.equal(P[20:], torch.randn(492, 384, generator=torch.Generator().manual_seed(3)) * 0.02)
    ids = torch.randint(1000, 2000, (1, 30))
    with torch.no_grad():
        assert torch.equal(si(ids[:, :20]).last_hidden_state, full(ids[:, :20]).last_hidden_state)
        assert not torch.allclose(si(ids).last_hidden_state[:, 20:], full(ids).last_hidden_state[:, 20:], atol=1e-3)


def test_the_smoke_standin_keeps_minilms_first_blocks():
    from transformers import AutoModel
    from captionbert.data import bundled_minilm_path
    from captionbert.arm import DepthArm, DepthModel, standin_trunk
    si, one = standin_trunk(20, layers=1), AutoModel.from_pretrained(str(bundled_minilm_path())).eval()
    one.encoder.layer = one.encoder.layer[:1]                                                    # MiniLM's first block alone
    assert (len(si.encoder.layer), si.config.num_hidden_layers, si.standin["source"]) == (1, 1, "all-MiniLM-L6-v2 (bundled), first 1 blocks")
    ids = torch.randint(1000, 2000, (2, 20))
    with torch.no_grad(): assert torch.equal(si(ids).last_hidden_state, one(ids).last_hidden_state)   # inside the cut: the first block, not another
    arm = DepthArm(si, 20, 64, rank=2)
    assert arm.adapters.layers == 1                                                              # one adapter per kept block (sized from the config)
    with pytest.raises(GuardError, match="backbone-bound"): DepthModel(standin_trunk(20), arm)   # the one-block stand-in is another trunk
    for bad in (0, 7):
        with pytest.raises(ValueError, match=rf"layers must be in \[1, 6\], got {bad}"): standin_trunk(20, layers=bad)


def test_the_standins_distillation_starts_on_the_depths_to_repair():
    "Born identity, the map leaves nothing to fit inside the cut (trunk and teacher agree there); born random, everything. Catches a map born random."
    from transformers import AutoModel
    from captionbert.data import bundled_minilm_path
    from captionbert.arm import DepthArm, DepthModel, standin_trunk
    from captionbert.depth import TokenDistill
    from captionbert.data import collate
    si, teacher = standin_trunk(20, seed=0), AutoModel.from_pretrained(str(bundled_minilm_path())).eval()
    ids = torch.randint(1000, 2000, (2, 40)); ids[:, 0], ids[:, -1] = 101, 102
    loss = lambda init, n: TokenDistill(teacher)(DepthModel(si, DepthArm(si, 20, 64, 2, distill_width=384, distill_init=init)),
                                                  collate(ids[:, :n].tolist()), None)[0].item()
    with torch.no_grad():
        assert loss("identity", 20) < 1e-5                   # inside the cut: nothing to fit
        assert loss("identity", 40) > 1e-3                   # past it: the copied rows differ from the teacher's learned ones
        assert loss("random", 20) > 0.5                      # a random map: the loss is the map's, everywhere


def test_a_depth_arm_on_a_bert_trunk_is_saved_alone_and_read_back_through_the_guard(tmp_path):
    "Round trip on the hooks path; a sibling BERT one seed away refused; a file whose tensors do not match its spec refused. Catches a save that drops the adapters."
    from safetensors.torch import load_file, save_file
    from captionbert.data import load_tokenizer
    from captionbert.arm import DepthArm, DepthModel, load_depth_arm, save_depth_arm
    bert, tok = _tiny_bert(vocab=30522), load_tokenizer()                                     # the workbook's WordPiece ids (the disengage check reads text)
    arm = DepthArm(bert, trained=16, length=64, rank=4, distill_width=16)
    with torch.no_grad(): arm.adapters.up[1].weight.normal_()
    p = save_depth_arm(arm, tmp_path / "arm.safetensors")
    assert not any(k.startswith("distill.") for k in load_file(str(p)))                     # the training-only map stays behind
    ids = torch.randint(1000, 2000, (2, 40))
    with torch.no_grad():
        assert torch.equal(load_depth_arm(p, bert, tok)(ids).last_hidden_state, DepthModel(bert, arm)(ids).last_hidden_state)
        assert not torch.equal(load_depth_arm(p, bert, tok)(ids).last_hidden_state, DepthModel(bert, DepthArm(bert, 16, 64, 4))(ids).last_hidden_state)
    with pytest.raises(GuardError, match="backbone-bound"): load_depth_arm(p, _tiny_bert(seed=1, vocab=30522), tok)
    t = load_file(str(p)); t.pop("adapters.up.1.weight")
    from safetensors import safe_open
    with safe_open(str(p), "pt") as f: meta = f.metadata()
    save_file(t, str(tmp_path / "short.safetensors"), metadata=meta)
    with pytest.raises(GuardError, match="does not hold the tensors its spec"): load_depth_arm(tmp_path / "short.safetensors", bert, tok)
