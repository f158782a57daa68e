"""Every control of the workbook outside the splat battery (tests/test_splat.py holds those) can pass: a planted input
on which the control says "passes" (or "separates", "ties", "woke"), beside the input on which it fails. A control that
cannot pass proves nothing when it fails (LAWS.md law 5). Fast, no data: each input is planted here."""
import pytest
import torch
import torch.nn.functional as F

from captionbert.core import GuardError


# --- 06_amoe: the random arm of greedy_roster (LAWS.md law 13) ------------------------------------------------------------

def _roster(gain, random_gain):
    from captionbert.amoe import greedy_roster
    from captionbert.adapters import Arm
    score = lambda arms: 0.5 + sum(gain.get(a.name, random_gain) for a in arms)      # a closed case: every random arm adds random_gain
    return greedy_roster({n: Arm(n, 8, 1, 2) for n in gain}, score, lambda i: Arm(f"random-{i}", 8, 1, 2, random_init=True), log=lambda *_: None)


def test_amoe_random_arm_can_win():
    "Planted: a random arm of the same size adds .05, more than any candidate (.04, .01): the control wins and no arm is admitted."
    r = _roster({"a": 0.04, "b": 0.01}, random_gain=0.05)
    assert r["roster"] == [] and r["halted"].startswith("no candidate beats adding a random arm"), r
    assert r["steps"][0]["random"] == pytest.approx(0.55)                            # the random arm was scored, as its own library


def test_amoe_random_arm_can_lose():
    r = _roster({"a": 0.10, "b": 0.05, "c": -0.01}, random_gain=0.02)                 # 06_amoe's closed case: a and b beat it, c does not
    assert r["roster"] == ["a", "b"] and "random" in r["halted"], r


# --- 08_alephlm: a3 (frozen anchors) and a4 (softmax) against a1; the wake gate; S0a, S0e; a2 along the path ------------

def _woke(share):
    from captionbert.alephlm import dispatch_woke
    return dispatch_woke({"routing/dispatch_share/block0": 0.0, "routing/dispatch_share/block1": share})


def test_alephlm_a3_a4_controls_can_tie_or_beat_a1():
    "Planted: a1 woke, and the frozen-anchor arm (a3) ends within the band of it, the softmax arm (a4) above it: each control matches or beats the routed trunk."
    from captionbert.alephlm import S0E_BAND, addressing_reading
    band = S0E_BAND["target_cosine"]
    tie = addressing_reading("a3", _woke(0.4), _woke(0.3), 0.5 * band)
    assert tie.startswith("both woke") and "inside the band" in tie and "carries no measurable objective" in tie, tie
    beat = addressing_reading("a4", _woke(0.4), _woke(0.3), -3 * band)
    assert "outside the band" in beat and "a1 trails" in beat, beat
    lead = addressing_reading("a4", _woke(0.4), _woke(0.3), 3 * band)                   # and the control can lose
    assert "a1 leads" in lead, lead


def test_alephlm_wake_gate_can_open_and_stay_shut():
    "dispatch_woke is the gate before any a1-vs-a3/a4 reading: planted shares open it (one block at the bar) or keep it shut (every block under it)."
    from captionbert.alephlm import WOKE_SHARE, addressing_reading
    assert _woke(WOKE_SHARE)["woke"] and _woke(WOKE_SHARE)["note"] is None
    shut = _woke(0.9 * WOKE_SHARE)
    assert not shut["woke"] and shut["note"].startswith("addressing untested")
    assert "untested" in addressing_reading("a3", shut, _woke(0.5), 0.05)             # a sleeping a1 reads nothing about addressing


def test_alephlm_s0a_reads_every_band():
    "S0a's ratio is judged by bands declared first: planted ranks land in each of the three readings."
    from captionbert.alephlm import S0A_BANDS, s0a_verdict
    lo, hi = S0A_BANDS
    assert s0a_verdict(20.0, 20.0 * lo)["verdict"] == "the member's own geometry"
    assert s0a_verdict(20.0, 20.0 * hi)["verdict"] == "the consensus construction"
    assert s0a_verdict(20.0, 20.0 * (lo + hi) / 2)["verdict"] == "intermediate"


def test_alephlm_s0e_can_tie_split_or_crown():
    from captionbert.alephlm import S0E_BAND, s0e_verdict
    b = S0E_BAND
    crown = s0e_verdict({"cls": {"target_cosine": .80, "mimicry_r1": .90}, "mean": {"target_cosine": .80 - 2 * b["target_cosine"], "mimicry_r1": .90 - 2 * b["mimicry_r1"]}})
    assert crown["verdict"].startswith("cls wins every gauge read, outside the tie band"), crown
    tie = s0e_verdict({"cls": {"target_cosine": .80, "mimicry_r1": .90}, "mean": {"target_cosine": .80 - b["target_cosine"] / 2, "mimicry_r1": .90 - b["mimicry_r1"] / 2}})
    assert tie["verdict"].startswith("a tie inside the band"), tie                       # the control readout (mean) ties: S0e's claim fails
    split = s0e_verdict({"cls": {"target_cosine": .80, "mimicry_r1": .80}, "mean": {"target_cosine": .79, "mimicry_r1": .90}})
    assert split["verdict"] == "split: different readouts win different gauges", split


def test_alephlm_dense_control_can_catch_a1_along_the_path():
    "path_claim reads a1 against a2 (the dense control): planted paths where a2 ties all along (the claim fails) and where a1 leads then ties (it holds)."
    from captionbert.alephlm import S0E_BAND, path_claim
    b = S0E_BAND["target_cosine"]
    up = lambda ds: [{"step": 10 * (i + 1), "target_cosine": 0.5 + d} for i, d in enumerate(ds)]
    assert path_claim(up([0, 0, 0, 0]), up([0, 0, 0, 0]))["verdict"].startswith("does not reproduce")
    assert path_claim(up([3 * b, 3 * b, 3 * b, 0]), up([0, 0, 0, 0]))["verdict"] == "reproduces: leads along the path and ties at the end"
    assert "trails" in path_claim(up([-3 * b, 3 * b, 3 * b, 0]), up([0, 0, 0, 0]))["verdict"]


# --- 03_alignment: the positive control and the R@1 control (LAWS.md law 5) ----------------------------------------------

def _fits(r1_in, r1_out, cos_in, cos_out, nd, teacher="glove"):
    from captionbert.alignment import AlignmentScore
    s = lambda split, r1, cos: AlignmentScore(teacher, split, 500, 500, r1, r1 * 500, cos, nd)
    return {teacher: (s("in-sample", r1_in, cos_in), s("out-of-sample", r1_out, cos_out))}


def test_alignment_positive_control_can_pass_and_fail():
    "Planted: the fit at N/d 4.9 loses .64 out of sample (R@1 + cosine), the fit at N/d 31 loses .06: the control holds; swapped, or a fit against itself, it fails."
    from captionbert.alignment import positive_control
    small, large = _fits(.99, .60, .95, .70, 4.9), _fits(.97, .93, .90, .88, 31.3)
    held = positive_control(small, large)
    assert held["glove"] == pytest.approx((.64, .06))
    for a, b in ((large, small), (large, large)):
        with pytest.raises(GuardError, match="positive control failed"): positive_control(a, b)


def test_alignment_r1_control_can_pass_and_fail():
    from captionbert.alignment import r1_control
    small, large = _fits(.99, .60, .95, .70, 4.9), _fits(.97, .93, .90, .88, 31.3)
    assert r1_control(small, large, ["glove"]) == {"glove": (.60, .93)}               # R@1 gap .39 >= 3 x .04, 465x chance
    with pytest.raises(GuardError, match="R@1 control failed"): r1_control(large, small, ["glove"])
    with pytest.raises(GuardError, match="R@1 control failed"): r1_control(small, _fits(.97, .01, .9, .88, 31.3), ["glove"])   # 5x chance
    with pytest.raises(GuardError, match="has none"): r1_control(small, large, [])


# --- 02a_retrieval: the random-init floor and the permuted-label control ---------------------------------------------------

IMS = [f"img{i // 5}" for i in range(500)]                                          # 100 images of 5 captions each (chance R@1 ~ 4/499)


def _scene(noise=0.01, seed=0):
    "An embedding that knows the scenes: each caption at its image's one-hot direction."
    return F.one_hot(torch.tensor([i // 5 for i in range(500)]), 100).float() + noise * torch.randn(500, 100, generator=torch.Generator().manual_seed(seed))


def _result(emb):
    from captionbert.retrieval import RETRIEVAL_TEST, retrieval_metrics
    return {"task": RETRIEVAL_TEST, "metrics": {f"{RETRIEVAL_TEST}/map": retrieval_metrics(emb, IMS)["map"]}}


def test_retrieval_floor_can_match_the_model():
    "Planted: a floor that knows the scenes is not separated from the model (the floor control passes); a floor of noise is."
    from captionbert.retrieval import floor_separates
    assert not floor_separates(_result(_scene()), _result(_scene(seed=1)))
    assert floor_separates(_result(_scene()), _result(torch.randn(500, 100, generator=torch.Generator().manual_seed(2))))


def test_retrieval_label_control_can_keep_its_score():
    "Planted: an embedding of the permuted labels keeps its score under them (the label control passes, nothing is separated); a scene embedding falls to chance."
    from captionbert.retrieval import label_control, permuted_labels
    assert label_control(_scene(), IMS)["separates"]
    knows = F.one_hot(torch.tensor([int(g[3:]) for g in permuted_labels(IMS, 0)]), 100).float()
    lc = label_control(knows, IMS, seed=0)
    assert not lc["separates"] and lc["control"]["map"] == pytest.approx(1.0), lc["control"]


# --- 11_rotary: lookup_probe's control heads (the relative option, an untrained binding model) ----------------------------

def test_rotary_lookup_probe_control_can_read_the_records():
    "The probe reports what a head reads: a planted head that attends exactly to each repeated word's record reads 1.0 (a control head that did so would be reported so); an untrained binding head reads low."
    from captionbert.data import load_tokenizer
    from captionbert.encoder import CaptionEncoder, EncoderConfig
    from captionbert.positions import pointer_targets, wordpiece_kinds
    from captionbert.rotary import lookup_probe
    tok = load_tokenizer()
    caps = ["a dog chases a dog in the park", "a man and a woman and a child", "two birds sit on a wire", "a snowboarder and a snowboarder ."]
    torch.manual_seed(0); untrained = CaptionEncoder(EncoderConfig.tiny(position="binding")).eval()

    class Reader(torch.nn.Module):                                                  # attends from each query to its record, nothing else
        config = untrained.config
        def __init__(self): super().__init__(); self.w = torch.nn.Parameter(torch.zeros(1))   # the probe reads the model's device from a parameter
        def forward(self, ids, mask, output_attentions=False):
            tg = pointer_targets(ids, wordpiece_kinds(self.config.vocab_size)[ids].long(), mask.bool())
            a = torch.zeros(*ids.shape, ids.shape[1]); a[..., 0] = 1.0
            has = tg >= 0; a[has] = F.one_hot(tg[has], ids.shape[1]).float()
            return type("Out", (), {"attentions": [a[:, None]]})()

    read = lookup_probe(Reader(), tok, caps)
    assert (read["argmax_rate"], read["mean_probability"], read["queries"]) == (1.0, 1.0, 7), read
    low = lookup_probe(untrained, tok, caps)
    assert low["queries"] == 7 and low["argmax_rate"] < 0.9, low


# --- 09_binding: the binding control (Unmixed), the bag-of-words item check, and recoverability's two controls ---------------

class _Words:
    "A whitespace tokenizer, one id a word; `pieces` cuts a word into that many ids (a word-piece length planted per word)."
    cls_token_id, sep_token_id = 101, 102
    def __init__(self, pieces=None): self.vocab, self.pieces = {}, pieces or {}
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault((w, k), 1000 + len(self.vocab)) for w in text.split() for k in range(self.pieces.get(w, 1))]}


def _binding(reader, tok, fit, held, depth=4):
    from captionbert.binding import binding_probe, probe_set
    pf, ph = probe_set(tok, fit, [7] * 40, depth, 96), probe_set(tok, held, [7] * 40, depth, 96)
    s = lambda b: reader(b.input_ids, b.attention_mask).last_hidden_state
    return binding_probe(s(pf.batch), pf, s(ph.batch), ph)


def _pairs(n, seed, side):
    "n items of two distinct colours, each side built by side(c0, c1, rng)."
    import numpy as np
    from captionbert.sources import COLOURS
    from captionbert.binding import BindingItem
    rng = np.random.default_rng(seed)
    return [BindingItem(i, seed, *side(*(COLOURS[int(j)] for j in rng.choice(len(COLOURS), 2, replace=False)), rng)) for i in range(n)]


def test_depth_unmixed_binding_control_can_pass():
    "Planted: minimal pairs whose nouns keep their slots (a <c> dog ... a <c'> cat) and colour i cut into i + 1 pieces: a reader in which no token sees another reads object->attribute .75 (the first noun off its position; the second sits at one position on both sides, exactly chance) and attribute->object 1.0 (the slot names the noun): binding holds at the bar. On grammar items (nouns drawn at random, one piece a word) it fails."
    from captionbert.sources import COLOURS, Scene, SceneObject
    from captionbert.binding import Unmixed, binding_items
    g = torch.Generator().manual_seed(0)
    unmixed = Unmixed(torch.randn(3000, 48, generator=g), torch.randn(96, 48, generator=g))
    scene = lambda x, y: Scene((SceneObject("dog", colour=x), SceneObject("cat", colour=y)), ("next to",))
    slotted = lambda n, seed: _pairs(n, seed, lambda c0, c1, rng: (scene(c0, c1), scene(c1, c0)))
    r = _binding(unmixed, _Words({c: i + 1 for i, c in enumerate(COLOURS)}), slotted(60, 0), slotted(30, 1))
    assert (r["object_to_attribute"], r["attribute_to_object"], r["verdict"]) == (0.75, 1.0, "holds"), r
    r = _binding(unmixed, _Words(), binding_items(48, seed=5), binding_items(32, seed=6))
    assert r["verdict"] == "fails" and r["object_to_attribute"] == 0.5, r


def test_depth_bag_of_words_binds_items_that_are_not_minimal_pairs():
    "The bag of words is an item check: on minimal pairs it reads exactly .5 on every item (a pair's sides share one bag); planted items that are not minimal pairs (each noun always with its own colour, side b another scene of that pairing) it binds both ways."
    import numpy as np
    from captionbert.sources import COLOURS, NOUNS, Scene, SceneObject
    from captionbert.binding import BagOfWords, BindingItem, binding_items
    bow, tok = BagOfWords(torch.randn(3000, 48, generator=torch.Generator().manual_seed(0))), _Words()
    r = _binding(bow, tok, binding_items(40, seed=5), binding_items(20, seed=6))
    assert (r["object_to_attribute"], r["attribute_to_object"], r["ci95"]) == (0.5, 0.5, (0.5, 0.5)), r
    own = {n: COLOURS[i % len(COLOURS)] for i, n in enumerate(NOUNS)}
    def world(n, seed):
        rng, out = np.random.default_rng(seed), []
        scene = lambda x, y: Scene((SceneObject(x, colour=own[x]), SceneObject(y, colour=own[y])), ("next to",))
        while len(out) < n:
            a, b, c, d = (NOUNS[int(j)] for j in rng.choice(len(NOUNS), 4, replace=False))
            if len({own[a], own[b], own[c], own[d]}) == 4: out.append(BindingItem(len(out), seed, scene(a, b), scene(c, d)))
        return out
    r = _binding(bow, tok, world(60, 2), world(20, 3))
    assert r["verdict"] == "holds" and min(r["object_to_attribute"], r["attribute_to_object"]) > 0.9, r


def _sentences(tok, texts):
    from captionbert.data import collate
    return collate([[101, *tok(t)["input_ids"], 102] for t in texts])


def test_depth_position_only_control_can_recover_a_template():
    "Planted: every sentence one template (the same words in the same order): position alone tells the token, and the position-only control recovers it; on varied sentences it fails."
    from captionbert.binding import PositionOnly, read_states, token_recoverability
    from captionbert.sources import NOUNS
    tok, table = _Words(), torch.randn(3000, 48, generator=torch.Generator().manual_seed(1))
    po = PositionOnly(torch.randn(64, 48, generator=torch.Generator().manual_seed(2)))
    read = lambda f, h: token_recoverability(read_states(po, f), f, read_states(po, h), h, table, [101, 102])
    one = _sentences(tok, ["a dog runs on the beach ."] * 30)
    assert read(one, _sentences(tok, ["a dog runs on the beach ."] * 10))["verdict"] == "recoverable"
    varied = lambda seed: [" ".join(NOUNS[(seed * 7 + i * 3 + j * 5) % len(NOUNS)] for j in range(6)) for i in range(30)]
    r = read(_sentences(tok, varied(0)), _sentences(tok, varied(1)))
    assert r["verdict"] == "not recoverable", r


def test_depth_shuffled_states_control_can_pass_on_rows_of_one_token():
    "Planted: each row repeats one token, so order carries nothing and shuffling a row's states keeps (almost) every token's own state: the shuffled control recovers the tokens; on varied rows it fails."
    from captionbert.binding import shuffled_states, token_recoverability
    from captionbert.sources import NOUNS
    tok, table = _Words(), torch.randn(3000, 48, generator=torch.Generator().manual_seed(3))
    states = lambda b: table[b.input_ids] * b.attention_mask[..., None]
    read = lambda f, h: token_recoverability(states(f), f, shuffled_states(states(h), h.attention_mask), h, table, [101, 102])
    varied = lambda seed: [" ".join(NOUNS[(seed * 7 + i * 3 + j * 5) % len(NOUNS)] for j in range(8)) for i in range(20)]
    fit = _sentences(tok, varied(0))                                                 # the map is fit on ordinary, unshuffled sentences
    r = read(fit, _sentences(tok, [" ".join([w] * 40) for w in NOUNS[:8]]))
    assert r["verdict"] == "recoverable", r
    r = read(fit, _sentences(tok, varied(1)))
    assert r["verdict"] == "not recoverable", r
