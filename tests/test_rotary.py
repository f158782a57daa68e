"""CaptionBERT-8192-rotary beyond its notebook: the released default's count on the meta device, the relative property
against a learned-position control, an export whose config names learned positions (refused natively and by AutoModel),
the exported tokenizer's length limit, a serving verifier that fails a perturbed export (and passes the honest one), a
hierarchical export (left padding changes it once trained), the Run section's list parameters as papermill hands them over,
and the vectorized pointer targets against the per-word loop they replaced. Temporary folders are pytest's (cleaned by it)."""
import json
import shutil

import pytest
import torch

from captionbert.encoder import CaptionEncoder, EncoderConfig, n_params


def test_released_default_count_on_meta():
    with torch.device("meta"):
        assert n_params(CaptionEncoder(EncoderConfig.v2(position="rotary", heads=16, rope_scale=4.0))) == 54_114_560


def test_left_padding_is_a_shift_only_relative_rotary_ignores():
    row = torch.tensor([[101, 2023, 2003, 1037, 3899, 102]]); left = torch.cat([torch.zeros(1, 7, dtype=torch.long), row], 1)
    gaps = {}
    for pos in ("rotary", "learned"):
        torch.manual_seed(0); m = CaptionEncoder(EncoderConfig.tiny(position=pos)).eval()
        with torch.no_grad(): gaps[pos] = (m(row).pooler_output - m(left, left.ne(0).long()).pooler_output).abs().max().item()
    assert gaps["rotary"] < 1e-5 and gaps["learned"] > 1e-3, gaps


def test_over_capacity_is_refused():
    m = CaptionEncoder(EncoderConfig.tiny(position="rotary", max_positions=8192))
    with pytest.raises(ValueError, match="8193 tokens but this rotary encoder's checked capacity is 8192"):
        m(torch.ones(1, 8193, dtype=torch.long))


@pytest.fixture(scope="module")
def rotary_export(tmp_path_factory):
    from captionbert.data import load_tokenizer
    from captionbert.hf import export_pretrained
    torch.manual_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny(position="rotary", rope_scale=4.0, max_positions=8192)).eval()
    return model, export_pretrained(model, load_tokenizer(), tmp_path_factory.mktemp("export") / "rotary")


def test_verifier_passes_the_export_and_fails_a_perturbed_one(rotary_export, tmp_path):
    from safetensors.torch import load_file, save_file
    from captionbert.hf import SERVING_CASES, SERVING_REPORT, seal_export, verify_serving
    model, folder = rotary_export
    cases = [c for c in SERVING_CASES if c[2] <= 64]                    # the short cases: the long ones run in 01c and 11
    good = verify_serving(model, folder, cases=cases)
    assert good.passed and all(c["max_diff"] == 0.0 for c in good.cases)
    broken = tmp_path / "perturbed"; shutil.copytree(folder, broken)
    w = load_file(str(broken / "model.safetensors")); w["encoder.final_norm.weight"] += 0.1
    save_file(w, str(broken / "model.safetensors"), metadata={"format": "pt"})
    seal_export(broken)                                                 # a wrong export sealed as written: the verifier's case, not the manifest's
    bad = verify_serving(model, broken, cases=cases)
    assert not bad.passed and all(c["token_max_diff"] > 1e-2 for c in bad.cases)
    assert json.loads((broken / SERVING_REPORT).read_text())["passed"] is False


def test_rotary_export_loaded_as_learned_is_refused(rotary_export, tmp_path):
    from captionbert.hf import load_pretrained, seal_export
    model, folder = rotary_export
    other = tmp_path / "edited"; shutil.copytree(folder, other)
    cfg = json.loads((other / "config.json").read_text()); cfg["encoder"]["position"] = "learned"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json has sha256"):       # the manifest refuses the edit first ...
        load_pretrained(other)
    seal_export(other)                                                  # ... and sealed after it, the weights' own check does
    with pytest.raises(ValueError, match="weights are of a rotary-position encoder, but this encoder's positions are learned"):
        load_pretrained(other)
    import sys
    from unittest import mock
    from transformers import AutoModel
    with mock.patch.dict(sys.modules, {"captionbert": None}), \
         pytest.raises(ValueError, match=r"do not fit its config.json \(positions 'learned'.*missing_keys.*position"):
        AutoModel.from_pretrained(str(other), trust_remote_code=True)   # transformers alone loads it with a warning
    cfg["encoder"].update(position="rotary", rope_scale=1.0); (other / "config.json").write_text(json.dumps(cfg)); seal_export(other)
    with pytest.raises(ValueError, match=r"rotary \(base, scale\) = \(10000.0, 4.0\)"):
        load_pretrained(other)


def test_hierarchical_export_serves_like_native(tmp_path):
    """The third model kind of the rotary card: its value path (given weights, so it matters) travels in the export. Once trained,
    hierarchical is no longer relative: its address is absolute (arange over the padded row), so left padding changes it; born, it is
    the relative model and left = right."""
    from captionbert.data import load_tokenizer
    from captionbert.hf import SERVING_CASES, export_pretrained, verify_serving
    torch.manual_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny(position="hierarchical", rope_scale=4.0)).eval()
    short = [c for c in SERVING_CASES if c[2] <= 64]
    born = {p["name"]: p for p in verify_serving(model, export_pretrained(model, load_tokenizer(), tmp_path / "born"),
                                                 cases=short[:1], save=False).padding}
    with torch.no_grad(): model.positions.value_path.normal_(0, 0.5)        # trained-like: the address reaches the output
    rep = verify_serving(model, export_pretrained(model, load_tokenizer(), tmp_path / "hier"), cases=short)
    assert rep.passed, rep
    pad = {p["name"]: p for p in rep.padding}
    assert born["left_vs_right"]["sentence_max_diff"] < 1e-4, born          # zero-born: the relative model, shift-free
    assert pad["right_vs_unpadded"]["sentence_max_diff"] < 1e-5, pad        # right padding keeps every real token's address
    assert pad["left_vs_right"]["sentence_max_diff"] > 1e-2, pad            # left padding moves them: not relative once trained


def test_exported_tokenizer_limit_is_the_model_capacity(rotary_export):
    from transformers import AutoTokenizer
    model, folder = rotary_export
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.model_max_length == model.config.max_positions == 8192, tok.model_max_length
    assert len(tok("word " * 1000, truncation=True)["input_ids"]) == 1002     # truncation reads the model's limit, not BERT's 512


def test_run_list_parameters_as_papermill_passes_them():
    "papermill -p values go through its own type resolution and Python codification, then the Run section's parameter_list."
    pytest.importorskip("papermill")
    from papermill.cli import _resolve_type
    from papermill.translators import PythonTranslator
    from captionbert.rotary import RotaryConfig, parameter_list
    for raw_options, raw_seeds in (('["relative", "learned"]', "1,2"), ("relative,learned", "[1, 2]")):
        ns = {}
        exec(PythonTranslator.codify({"options": _resolve_type(raw_options), "seeds": _resolve_type(raw_seeds)}), ns)
        cfg = RotaryConfig.preset("cpu", options=parameter_list(ns["options"]), seeds=parameter_list(ns["seeds"], int))
        assert (cfg.options, cfg.seeds) == (("relative", "learned"), (1, 2))
    ns = {}
    exec(PythonTranslator.codify({"seeds": _resolve_type("2")}), ns)          # one value: papermill makes it an int
    assert parameter_list(ns["seeds"], int) == (2,)


def _pointer_targets_by_loop(input_ids, kind, token_mask):
    "The per-word Python reading of positions.pointer_targets (its first implementation): the reference the vectorized one must equal."
    out = torch.full(input_ids.shape, -1, dtype=torch.long)
    ids, kd, tm = input_ids.tolist(), kind.tolist(), token_mask.tolist()
    for b in range(len(ids)):
        seen, p, L = {}, 0, len(ids[b])
        while p < L:
            if not tm[b][p] or kd[b][p] != 0: p += 1; continue
            e = p + 1
            while e < L and tm[b][e] and kd[b][e] == 1: e += 1
            w = tuple(ids[b][p:e])
            if w in seen: out[b, p] = seen[w]
            seen[w] = p; p = e
    return out


def test_pointer_targets_equal_the_per_word_loop():
    "Random batches over a small vocabulary (many repeats, multi-piece words, '##' after specials and padding, holes in the mask, empty rows)."
    from captionbert.data import load_tokenizer
    from captionbert.positions import pointer_targets, wordpiece_kinds
    g = torch.Generator().manual_seed(0)
    multi = 0
    for trial in range(300):
        B, L, V = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(3, 16, (1,), generator=g))
        kind_of = torch.randint(0, 3, (V,), generator=g)
        ids = torch.randint(0, V, (B, L), generator=g)
        tm = (torch.arange(L) < torch.randint(0, L + 1, (B, 1), generator=g)) & (torch.rand(B, L, generator=g) > 0.05)   # right padding, some holes
        kind = kind_of[ids]                                                             # masked positions keep word-like ids: the mask must decide
        want = _pointer_targets_by_loop(ids, kind, tm)
        assert torch.equal(pointer_targets(ids, kind, tm), want), (trial, ids, kind, tm)
        multi += int(((kind[:, :-1] == 0) & (kind[:, 1:] == 1) & tm[:, 1:] & (want[:, :-1] >= 0)).sum())
    assert multi > 20, multi                                                            # multi-piece words with targets were exercised
    rows = ["a snowboarder jumps and a snowboarder lands in the snow .", "a dog runs", "the snowboarders and the snowboarder", ""]
    enc = load_tokenizer()(rows, padding="max_length", max_length=24, return_tensors="pt")
    ids, tm = enc["input_ids"], enc["attention_mask"].bool(); kind = wordpiece_kinds(30522).long()[ids]
    got = pointer_targets(ids, kind, tm)
    assert torch.equal(got, _pointer_targets_by_loop(ids, kind, tm)) and int((got >= 0).sum()) == 3, got   # a, snowboarder; the (snowboarders is another word)


def test_the_one_loop_refuses_a_binding_encoder_under_fp16_inside_any_wrapper(tmp_path):
    "Where the model meets the fp16 scaler: a binding encoder is refused before a step (catches a check left in 11's caller only)."
    import torch.nn as nn
    from captionbert.core import RunDir
    from captionbert.encoder import CaptionEncoder, EncoderConfig
    from captionbert.loop import TrainConfig, train
    wrapped = nn.ModuleDict({"inner": CaptionEncoder(EncoderConfig.tiny(position="binding"))})
    with pytest.raises(ValueError, match="cannot train in fp16"):
        train(wrapped, lambda step: None, lambda *a: None, TrainConfig(precision="fp16", max_steps=1), RunDir(tmp_path / "r"), {"rows": "none"})
    assert not (tmp_path / "r" / "checkpoints").exists()
