"""The splat block beyond its notebook: no [L, L] tensor is ever made (the linear-cost claim, checked on shapes, not
timed), gradient checkpointing, a native export round trip, and the screens' recipe reaching the model."""
import json
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from captionbert.encoder import ATTENTION_KINDS, CaptionEncoder, EncoderConfig, NoPositions, attention_kind


class _Shapes(TorchDispatchMode):
    "Record the shape of every tensor an op returns."
    def __init__(self): super().__init__(); self.shapes = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor): self.shapes.append(tuple(t.shape))
        return out


def _largest_square(kind: str, L: int, need_weights: bool = False) -> int:
    "How many tensors with two dimensions of at least L the attention of `kind` makes in one forward at length L."
    cfg = EncoderConfig.tiny(attention=kind)
    torch.manual_seed(0); attn = ATTENTION_KINDS[attention_kind(kind)](cfg)
    x = torch.randn(1, L, cfg.hidden)
    with torch.no_grad(), _Shapes() as rec: attn(x, None, NoPositions(cfg), need_weights)
    return sum(1 for s in rec.shapes if sum(d >= L for d in s) >= 2)


@pytest.mark.parametrize("kind", ["splat", "splat:frozen", "splat:rope+frame"])
def test_splat_never_makes_a_length_by_length_tensor(kind):
    assert _largest_square(kind, 300) == 0


def test_the_shape_check_can_fail():
    "The same check on SDPA's explicit path (the one that returns [B, H, L, L] weights) finds the square tensors."
    assert _largest_square("sdpa", 300, need_weights=True) > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(1000, 2000, (2, 10))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0); m = CaptionEncoder(EncoderConfig.tiny(attention="splat", gradient_checkpointing=ckpt)).train()
        m(ids).pooler_output.square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_native_export_round_trip():
    "A splat encoder is refused by the remote-code export (its block is not in the modeling file); exported as a native folder and loaded by the harness's loader it scores exactly as in memory (frozen anchors travel as a buffer)."
    from captionbert.data import load_tokenizer
    from captionbert.hf import export_pretrained, load_pretrained
    for kind in ("splat", "splat:frozen"):
        torch.manual_seed(0); m = CaptionEncoder(EncoderConfig.tiny(attention=kind)).eval()
        refused = Path(tempfile.mkdtemp()) / "refused"
        with pytest.raises(ValueError, match="cannot travel in the modeling file .* pass remote_code=False"):
            export_pretrained(m, load_tokenizer(), refused)
        assert not refused.exists()                                   # refused before anything was written
        folder = export_pretrained(m, load_tokenizer(), Path(tempfile.mkdtemp()) / "splat", remote_code=False)
        config = json.loads((folder / "config.json").read_text())
        assert "auto_map" not in config and not (folder / "modeling_captionbert.py").exists()
        back = load_pretrained(folder).eval()
        assert back.config.attention == kind
        ids = torch.randint(1000, 2000, (3, 7))
        assert torch.equal(m(ids).pooler_output, back(ids).pooler_output)


def test_the_screens_arms_differ_only_in_attention():
    from captionbert.splat import SCREEN_ARMS, ScreenConfig
    for size in ScreenConfig.PRESETS:
        cfg = ScreenConfig.preset(size)
        encs = {arm: cfg.encoder_config(arm) for arm in cfg.arms}
        assert {dataclasses.replace(e, attention="sdpa") for e in encs.values()} == {encs["standard"]}
        assert {arm: e.attention for arm, e in encs.items()} == {a: SCREEN_ARMS[a] for a in cfg.arms}
        tcs = {dataclasses.replace(cfg.train_config(arm), name="x") for arm in cfg.arms}
        assert len(tcs) == 1, "the arms of a screen must train with one recipe"


def test_the_sizes_come_from_core_presets():
    "Both configs of 10 dispatch through core.Presets: an unknown name is refused listing the names, and the battery's sizes keep the values they had as a dict."
    from captionbert.core import Presets
    from captionbert.splat import BatteryConfig, ScreenConfig, battery_size
    assert issubclass(ScreenConfig, Presets) and issubclass(BatteryConfig, Presets)
    with pytest.raises(ValueError, match=r"unknown screen size 'v2': one of \['smoke', 'cpu'\]"): ScreenConfig.preset("v2")
    with pytest.raises(ValueError, match=r"unknown battery size 'tiny': one of \['smoke', 'cpu', 'published'\]"): battery_size("tiny")
    base = dict(dim=64, budget=256, items=256, value_dim=64, noise=0.35)
    assert battery_size("smoke") == dict(base, trials=1, steps=30, train_steps=10, context=256, locality_heads=(1, 16, 256),
                                         locality_judged=16, lengths=(64, 128, 256))
    assert battery_size("cpu") == battery_size("published") == dict(base, trials=3, steps=300, train_steps=150, context=2048,
                                                                     locality_heads=(1, 16, 128, 2048), locality_judged=128,
                                                                     lengths=(256, 512, 1024, 2048))


def test_token_local_trains_the_frozen_splat_arms_budget():
    "01b's TokenLocal ('none') never reads the query and key rows of qkv: they get no gradient, and its live budget is the frozen splat arm's (cpu: 526,336 dead, 10,841,600 live)."
    counts = {}
    for kind in ("none", "splat:frozen"):
        torch.manual_seed(0); m = CaptionEncoder(EncoderConfig.preset("cpu", attention=kind))
        counts[kind] = sum(p.numel() for p in m.parameters() if p.requires_grad)
    torch.manual_seed(0); m = CaptionEncoder(EncoderConfig.preset("cpu", attention="none"))
    m(torch.randint(1000, 2000, (2, 7))).pooler_output.square().sum().backward()
    D = m.config.hidden
    dead = sum(int((b.attn.qkv.weight.grad[:2 * D] == 0).sum() + (b.attn.qkv.bias.grad[:2 * D] == 0).sum()) for b in m.blocks)
    assert all(b.attn.qkv.weight.grad[2 * D:].abs().sum() > 0 for b in m.blocks)      # the value rows do train
    assert dead == 526_336 == len(m.blocks) * 2 * (D * D + D)
    assert counts["none"] - dead == counts["splat:frozen"] == 10_841_600, counts
