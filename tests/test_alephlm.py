"""AlephLM-0 beyond its notebook: the a1/a2 step-time command, an anchored export whose config names another arm,
the 06a inspector on an anchored trunk, the NaN guard in training mode, and an arm's recipe reaching the one loop as
arguments (recorded in the run's config, routing vitals in its gauge records, another arm's resume refused)."""
import json
import tempfile
from pathlib import Path

import pytest
import torch

from captionbert.encoder import CaptionEncoder, EncoderConfig


def test_anchored_step_command(capsys):
    from captionbert.perf import main
    res = main(["--preset", "tiny", "--batch-size", "8", "--batches", "2", "--rounds", "2", "--device", "cpu", "--anchored"])
    assert json.loads(capsys.readouterr().out) == res
    steps = res["steps"]
    assert len(steps) == res["steps_timed"] == 4
    assert all(r["anchored"]["tokens"] == r["dense"]["tokens"] for r in steps), "a1 and a2 stepped on different batches"
    t = {k: sum(r[k]["s"] for r in steps) for k in ("anchored", "dense")}
    assert res["step_time_ratio_a1_vs_a2"] == pytest.approx(t["anchored"] / t["dense"], abs=1e-3)
    cfg = EncoderConfig.tiny()
    assert res["anchored"]["params"] - res["dense"]["params"] == cfg.layers * (2 * cfg.experts * cfg.hidden + cfg.experts)


def test_export_whose_config_names_another_arm_is_refused():
    "An a1 export whose config.json was edited to say softmax (a4) does not load: the weights carry their arm."
    from captionbert.data import load_tokenizer
    from captionbert.hf import export_pretrained, load_pretrained, seal_export
    torch.manual_seed(0)
    a1 = CaptionEncoder(EncoderConfig.tiny(ffn="anchored", readout="cls"))
    folder = export_pretrained(a1, load_tokenizer(), Path(tempfile.mkdtemp()) / "a1")
    assert torch.equal(load_pretrained(folder).blocks[0].ffn.anchors_birth, a1.blocks[0].ffn.anchors_birth)
    cfg = json.loads((folder / "config.json").read_text()); cfg["encoder"]["router"] = "softmax"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json has sha256"):       # the manifest refuses the edit; sealed after it, the weights do
        load_pretrained(folder)
    seal_export(folder)
    with pytest.raises(ValueError, match="router 'sinh', anchors learned, but this one has router 'softmax'"):
        load_pretrained(folder)
    cfg["encoder"].update(router="sinh", ffn="dense"); (folder / "config.json").write_text(json.dumps(cfg)); seal_export(folder)
    with pytest.raises(ValueError, match="this encoder's FFN is 'dense'"):
        load_pretrained(folder)


def test_inspector_reads_an_anchored_trunk():
    from captionbert.data import load_tokenizer
    from captionbert.inspector import routing_view
    torch.manual_seed(0)
    m = CaptionEncoder(EncoderConfig.tiny(ffn="anchored")).eval()
    tok = load_tokenizer()
    v = routing_view(m, tok, "a dog runs on the beach .", layer=1, active=["expert1", "expert3"], tau=0.05)
    assert v["arms"] == ["expert1", "expert2", "expert3"] and v["layers"] == 2
    assert all(row[1] == 0.0 for row in v["weights"]) and any(row[0] != 0.0 for row in v["weights"])   # expert2 off, the others on
    assert m.routing_tau == 0.10 and all(p.on == (True, True, True) for p in m._routed())              # restored after the view
    assert 0 < v["negative_fraction"] < 1


def test_nan_guard_in_training_with_checkpointing():
    torch.manual_seed(0)
    m = CaptionEncoder(EncoderConfig.tiny(ffn="anchored", gradient_checkpointing=True)).train()
    ids = torch.tensor([[101, 2000, 2003, 102, 0], [101, 2001, 2004, 2005, 102]])
    m(ids).pooler_output.sum().backward()                                    # finite: trains
    with torch.no_grad(): m.blocks[1].ffn.gates[0] = float("nan")
    with pytest.raises(FloatingPointError, match="block 1 .*NaN in its output"):
        m(ids)


def test_an_arm_reaches_the_one_loop_as_arguments(tmp_path):
    "train_arm_run hands its recipe, encoder and vitals to run_consensus_training: nothing patched, all recorded, a resume as another arm refused."
    import captionbert.train as T
    from captionbert.alephlm import AlephConfig, train_arm_run
    from captionbert.core import GuardError, to_jsonable
    before = (T.TrainConfig.preset, EncoderConfig.preset, T.ConsensusGauges)
    cfg = AlephConfig.smoke(recipe=(("eval_every", 2),), vitals_rows=16)
    job = train_arm_run(cfg, "a3", 0, tmp_path / "a3", "build", max_steps=4)
    assert (T.TrainConfig.preset, EncoderConfig.preset, T.ConsensusGauges) == before
    want_enc = cfg.encoder_config("a3", out_dim=job.targets.targets.dim)
    run_cfg = json.loads((tmp_path / "a3" / "config.json").read_text())
    assert run_cfg["encoder"] == to_jsonable(want_enc) and run_cfg["encoder"]["freeze_anchors"] is True
    assert run_cfg["train"] == to_jsonable(cfg.train_config("a3", max_steps=4)) and run_cfg["train"]["name"] == "aleph-a3-smoke"
    gauges = [r for r in job.run.metrics() if "gauge/target_cosine" in r]
    assert [r["step"] for r in gauges] == [2, 4] and all("routing/dispatch_share" in r and "routing/amplitude/block1" in r for r in gauges)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(tmp_path / "a3" / "tensorboard")); tb.Reload()
    assert "routing/dispatch_share" in tb.Tags()["scalars"]                          # the vitals reach TensorBoard as the gauges do
    with pytest.raises(GuardError, match="encoder.freeze_anchors: True -> False"):   # a1 into a3's directory
        train_arm_run(cfg, "a1", 0, tmp_path / "a3", str(job.targets.folder), max_steps=6)
    dense = train_arm_run(cfg, "a2", 0, tmp_path / "a2", str(job.targets.folder), max_steps=2)
    assert not any(k.startswith("routing/") for r in dense.run.metrics() for k in r)   # a dense trunk adds no vitals
