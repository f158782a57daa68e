"""The splat block beyond its notebook: no [L, L] tensor is ever made (the linear-cost claim, checked on shapes, not
timed), gradient checkpointing, a native export round trip, and the screens' recipe reaching the model."""
import json
import math
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from captionbert.encoder import ATTENTION_KINDS, CaptionEncoder, EncoderConfig, attention_kind
from captionbert.positions import NoPositions
from captionbert.splat_block import SplatAttention   # importing the block's module registers the "splat" attention kind


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
        assert config["captionbert_parts"] == [SplatAttention.__module__] == ["captionbert.splat_block"]   # the module that defines the block
        back = load_pretrained(folder).eval()
        assert back.config.attention == kind
        ids = torch.randint(1000, 2000, (3, 7))
        assert torch.equal(m(ids).pooler_output, back(ids).pooler_output)


def test_an_export_naming_either_splat_module_registers_the_block():
    "A fresh interpreter that imports the part module an export recorded gets the splat kind: captionbert.splat_block (recorded now) and captionbert.splat (recorded by exports made before the block had its own notebook, which imports it)."
    import subprocess, sys
    for part in ("captionbert.splat_block", "captionbert.splat"):
        code = ("from captionbert.encoder import ATTENTION_KINDS, import_parts; assert 'splat' not in ATTENTION_KINDS; "
                f"import_parts([{part!r}]); assert ATTENTION_KINDS['splat'].__module__ == 'captionbert.splat_block', ATTENTION_KINDS")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        assert r.returncode == 0, (part, r.stderr[-2000:])


def test_the_screens_arms_differ_only_in_attention():
    from captionbert.splat_block import SCREEN_ARMS, ScreenConfig
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
    from captionbert.splat_store import BatteryConfig, battery_size
    from captionbert.splat_block import ScreenConfig
    assert issubclass(ScreenConfig, Presets) and issubclass(BatteryConfig, Presets)
    with pytest.raises(ValueError, match=r"unknown screen size 'v2': one of \['smoke', 'cpu', 'recall'\]"): ScreenConfig.preset("v2")
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


# --- every control of the battery is its own measurement, and can pass -----------------------------------------------
# A control that cannot pass proves nothing when it fails (LAWS.md law 5). Each test below plants an input on which the
# control's own measurement clears its probe's bar, so the battery's "control fails" is a finding, not arithmetic.
# Before this change three controls were the probe's numbers with roles swapped (blend/shuffled, the router order, the
# two arms of trainability): on random inputs the probe and that control never both passed.

import random
import torch.nn.functional as F

from captionbert import splat as S

B = S.BatteryConfig.preset


def test_product_code_copies_control_can_pass():
    "Copies of one codebook read back as one codebook of budget/M anchors, so the copies control passes where a store reads better with fewer anchors: a hard (one-hot, tau 1e-4) address, very noisy queries (noise 1.0) and 8 items, where a noisy query lands in its key's own cell more often when cells are coarse."
    size = B("smoke", items=8, noise=1.0, trials=40)
    c = S.probe_product_code(size, 0, copies=True, tau=1e-4)
    xs = [c["readback"][m] for m in sorted(c["readback"])]
    assert xs[-1] - xs[0] > 0.06, c                                   # coarse copies gain as they split (.308 -> .380 when written)
    assert S.product_code_rule(c), c
    k, v, q = S.items(8, 64, 64, 1.0, 0)                               # the identity the control rests on: M copies = one codebook of A/M anchors
    assert S._readback("t", S.codebooks(16, 16, 64, 3, copies=True), k, v, q) == S._readback("t", S.codebooks(1, 16, 64, 3), k, v, q)
    assert not S.product_code_rule(S.probe_product_code("smoke", 0, copies=True)), "at the battery's own size the control fails"


def test_differentiation_alone_control_can_pass():
    "Codebooks that each read back alone differentiate too: born a little further apart (.015) at a softer address (tau .05), they end below the bar (.96 -> .47 at smoke dimensions, 64 items, 100 steps), so the control passes."
    c = S.probe_differentiation(B("smoke", items=64, steps=100), 0, shared=False, birth_noise=0.015, tau=0.05)
    assert c[min(c)] >= 0.9 and c[max(c)] <= 0.5, c
    assert S.differentiation_rule(c)


def _planted_store(sd, n=64, dv=32, sigma=2.0):
    "Four codebooks whose amplitudes say which are good at every query alike: two read each item's value through noise (amplitude 1), two read noise (amplitude .3)."
    g = torch.Generator().manual_seed(sd)
    v = F.normalize(torch.randn(n, dv, generator=g), dim=-1)
    eye = torch.eye(n)
    wq = torch.stack([eye, eye, .3 * eye[torch.randperm(n, generator=g)], .3 * eye[torch.randperm(n, generator=g)]], 1)   # [n, 4, n]
    good = lambda: v + sigma * torch.randn(n, dv, generator=g) / dv ** .5
    cells = torch.stack([good(), good(), 3 * torch.randn(n, dv, generator=g) / dv ** .5, 3 * torch.randn(n, dv, generator=g) / dv ** .5])
    return wq, cells, v, g


def test_blend_keyblind_control_can_pass():
    "The key-blind control (each query composed by another query's amplitudes) passes where amplitude tracks a codebook's quality at every query alike: then the blend's win is not the query's own amplitude, and the probe's verdict is not citable."
    r = S.two_seeds(lambda sd: S.compose_reads(*_planted_store(sd)), 0)
    kb = [k for k in r["mean"] if k.startswith("keyblind ")]
    probe = {"readback": {k: x for k, x in r["mean"].items() if k not in kb}, "floor": max(x for k, x in r["gaps"].items() if k not in kb)}
    control = S.blend_control({**probe, "keyblind": {k[len("keyblind "):]: r["mean"][k] for k in kb}, "keyblind_floor": max(r["gaps"][k] for k in kb)})
    assert S.blend_rule(probe) and S.blend_rule(control), (probe, control)   # both pass on one input: the control is not the probe relabelled
    assert control["readback"] != probe["readback"]                          # its shuffled read is its own draw
    with pytest.raises(ValueError, match="at least two queries"): S.compose_reads(*(_planted_store(0)[0][:1], *_planted_store(0)[1:]))


def test_blend_keyblind_control_is_measured_beside_the_probe():
    "At the battery's size and tau the key-blind reads are measured, not copied: the select read differs from the probe's (another query's loudest codebook)."
    v = S.run_probe("blend vs select", "smoke")
    assert set(v.control["readback"]) == {"blend", "select", "shuffled"}
    assert v.control["readback"]["select"] != v.numbers["readback"]["select"], (v.control, v.numbers)
    assert not v.control_passed


def test_storage_and_addressing_copies_controls_can_pass():
    "Near-copies pass: the storage bar (a rank at relative tolerance 1e-6) cannot tell codebooks 1e-3 apart from independent ones; codebooks .1 apart pass the addressing bar too. Exact copies fail both."
    c = S.probe_partitions("smoke", copies=True, jitter=1e-3)
    assert S.storage_rule(c) and not S.resolution_rule(c), c
    c = S.probe_partitions("smoke", copies=True, jitter=0.1)
    assert S.storage_rule(c) and S.resolution_rule(c), c
    exact = S.probe_partitions("smoke", copies=True)
    assert not S.storage_rule(exact) and not S.resolution_rule(exact)
    with pytest.raises(ValueError, match="jitter 0.1 moves copies apart, but copies=False"): S.codebooks(2, 4, 8, jitter=0.1)


def test_partially_blind_router_passes_both_bars():
    "The blind router (reads none of its key) fails both bars; one that reads 4 of the key's 64 coordinates still fails them, 12 pass addressing, 16 pass both: the two bars credit nearly any key-reading router."
    for reads, want in ((0, (False, False)), (4, (False, False)), (12, (False, True)), (16, (True, True))):
        r = S.probe_partitions("smoke", reads=reads)
        assert (S.storage_rule(r), S.resolution_rule(r)) == want, (reads, r)
    assert {x["storage"] for x in S.probe_partitions("smoke", reads=0).values()} == {1}
    with pytest.raises(ValueError, match="reads between 0 and 64"): S.probe_partitions("smoke", reads=65)


def _block_context():
    "64 tokens, 4 windows of 16: token i's key is the i-th basis vector, so a window's keys span their own 16 coordinates."
    k = torch.eye(64)
    v = F.normalize(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), dim=-1)
    q = F.normalize(k + 0.05 * torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) / 8, dim=-1)
    return k, v, q


def _block_books(heads, h, cells, d):
    "Head h's anchors are its window's own coordinates; the one store's are one direction repeated (it tells no key apart)."
    if heads == 1: return F.normalize(torch.ones(1, cells, d), dim=-1)
    return torch.eye(d)[h * cells:(h + 1) * cells][None]


def test_locality_nonlocal_control_can_pass():
    "Where other windows' tokens address nothing in a head (their keys orthogonal to its anchors: sinh(0) = 0), writing every head is writing one's own: the non-local control reads back as the local probe (1.0 vs .016 for the one store) and its memory grows linearly; its time slope, a wall-clock measurement no input controls, decides the rest."
    size = B("smoke", context=64, locality_heads=(1, 4), locality_judged=4, lengths=(16, 32, 64))
    c = S.probe_locality(size, 0, local=False, context=_block_context(), books=_block_books)
    p = S.probe_locality(size, 0, local=True, context=_block_context(), books=_block_books)
    assert c["heads"] == p["heads"], (c["heads"], p["heads"])
    assert c["heads"][4]["top1"] == 1.0 and c["heads"][4]["fidelity"] == 1.0 and c["heads"][1]["top1"] < 0.02, c["heads"]
    assert c["memory_slope"] <= 1.3, c["memory_slope"]
    assert S.locality_rule(c) == (c["time_slope"] <= 1.3)               # every other clause of the bar passes on this input
    assert S.locality_rule({**c, "time_slope": 1.0})
    bare = S.probe_locality("smoke", 0, local=False)                     # random keys and anchors: every token's write reaches every head
    assert not S.locality_rule(bare), bare["heads"]
    with pytest.raises(ValueError, match="a planted context is .* of 256 tokens"): S.probe_locality("smoke", context=_block_context())


def test_signed_matched_entropy_control_can_pass():
    "At a soft address (tau .3, 32 items) the signed rule's entropy is a sharper softmax's (tau ~.15), and that sharpening alone lifts softmax by more than the bar: the control passes, so a signed win there would not be the sign's."
    r = S.probe_signed_softmax(B("smoke", items=32, trials=10), 0, tau=0.3)
    c = S.signed_control(r)
    assert c["tau"] < 0.2 and S.signed_rule(c), c
    assert S.signed_rule(r)                                              # the probe passes on the same input: they are not exclusive
    v = S.run_probe("signed vs softmax", "smoke")                        # the battery's size and tau: the matched softmax is its own measurement
    assert v.control["order"] == ("softmax@entropy", "softmax") and abs(v.control["tau"] - S.BATTERY_TAU) > 1e-3, v.control
    assert v.control["readback"]["softmax"] == v.numbers["readback"]["softmax"] and not v.control_passed


def test_matched_tau_matches_the_entropy():
    k, _, _ = S.items(32, 64, 64, 0.35, 0); bk = S.codebooks(4, 16, 64, 0)
    t = S.matched_tau("t", k, bk, 0.05)
    assert abs(S.address_entropy(S.address("t", k, bk, t, "softmax")) - S.address_entropy(S.address("t", k, bk, 0.05, "sinh"))) < 1e-4
    assert S.address_entropy(torch.ones(2, 1, 8)) == pytest.approx(math.log(8)) and S.address_entropy(torch.eye(8)[None, None, 0].expand(2, 1, 8)) < 1e-6
    with pytest.raises(ValueError, match="outside what softmax reaches"): S.matched_tau("t", k, bk, 0.05, bracket=(0.5, 1.0))


def _students(frozen, other, splat, none, floor=0.02, static=0.9):
    return {"students": {"splat:frozen": {"static_readback": static, "gain": frozen}, S.TRAINABILITY_OTHER: {"static_readback": static, "gain": other},
                         "splat": {"static_readback": static, "gain": splat}, "none": {"static_readback": None, "gain": none}}, "floor": floor}


def test_trainability_other_seed_control_can_pass():
    "The control reads a separately trained student (the frozen block born at the next seed): it passes where two frozen blocks differ as the probe's pair must, in either order, and it can pass beside a passing probe."
    r = _students(frozen=.215, other=.40, splat=.263, none=.203)       # the frozen block at another seed trains far better: a lottery of births
    assert S.trainability_rule(r) and S.trainability_control(r)
    assert S.trainability_control(_students(frozen=.40, other=.215, splat=.263, none=.203))   # either way round
    assert not S.trainability_control(_students(frozen=.215, other=.213, splat=.263, none=.203))   # two births alike: the control fails
    v = S.run_probe("trainability", "smoke")
    st = v.numbers["students"]
    assert S.TRAINABILITY_OTHER in st and st[S.TRAINABILITY_OTHER]["gain"] != st["splat:frozen"]["gain"], st   # trained apart, not copied
    assert v.control == {"judged": "splat:frozen", "against": S.TRAINABILITY_OTHER, "either way round": True}
    assert v.control_passed == S.trainability_control(v.numbers)
    assert S.student_kind("splat:frozen@3") == ("splat:frozen", 3) and S.student_kind("sdpa") == ("sdpa", 0)
    with pytest.raises(ValueError, match="a seed offset"): S.student_kind("splat@x")


def test_probe_and_control_can_both_pass_on_random_inputs():
    "The three controls that were relabelled numbers are now separate numbers: on random inputs the probe and its control both pass on some (with the swap they never did)."
    rng, both = random.Random(0), {"blend": 0, "signed": 0, "trainability": 0}
    for _ in range(3000):
        u = lambda: rng.random()
        r = {"readback": {k: u() for k in ("blend", "select", "shuffled", "sum")}, "floor": u() / 20,
             "keyblind": {k: u() for k in ("blend", "select", "shuffled")}, "keyblind_floor": u() / 20}
        both["blend"] += S.blend_rule(r) and S.blend_rule(S.blend_control(r))
        soft = u()
        r = {"readback": {"sinh": u(), "softmax": soft}, "floor": u() / 20, "order": ("sinh", "softmax"),
             "matched": {"readback": {"softmax@entropy": u(), "softmax": soft}, "floor": u() / 20, "order": ("softmax@entropy", "softmax"), "tau": .03}}
        both["signed"] += S.signed_rule(r) and S.signed_rule(S.signed_control(r))
        r = _students(*(rng.uniform(-.1, .6) for _ in range(4)), floor=u() / 20)
        both["trainability"] += S.trainability_rule(r) and S.trainability_control(r)
    assert all(n > 0 for n in both.values()), both


def test_the_results_record_reads_each_verdict_beside_its_control():
    "A probe reproduces only beside a failing control; with its control passing too it cannot be measured here (LAWS.md law 5); failing, it does not reproduce. A planted size has no preset to name."
    v = S.run_probe("storage", "smoke")
    assert v.passed and not v.control_passed
    assert S._claim(v)[0] == "reproduces"
    assert S._claim(dataclasses.replace(v, control_passed=True))[0] == "cannot be measured here"
    assert S._claim(dataclasses.replace(v, passed=False))[0] == "does not reproduce"
    with pytest.raises(ValueError, match="names its preset"): S.battery_results({}, B("smoke"), 0)
