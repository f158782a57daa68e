"""Data parallelism: the one training loop under 2 gloo processes matches 1 process at the same global batch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _dist import one_and_two_processes
from captionbert.core import RunDir, set_seed
from captionbert.data import load_tokenizer
from captionbert.sources import SceneGrammar
from captionbert.encoder import CaptionEncoder, EncoderConfig
from captionbert.loop import BatchPlan, ConsensusLoss, TokenizedCorpus, TrainConfig, train

CFG = TrainConfig.smoke(max_steps=6, batch_size=16, warmup_steps=2, eval_every=1000, ckpt_every_steps=1000)


def _setup():
    corpus = TokenizedCorpus.from_texts(load_tokenizer(), list(SceneGrammar(n=200, seed=3)))
    g = torch.Generator().manual_seed(0)
    targets = F.normalize(torch.randn(len(corpus), 48, generator=g), dim=-1)
    return corpus, targets


def _run(folder):
    corpus, targets = _setup()
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny())
    train(model, BatchPlan(corpus, np.arange(200), CFG.batch_size, seed=0), ConsensusLoss(targets), CFG, RunDir(folder),
          {"corpus": "scene-grammar-3"}, resume=False, device="cpu", progress=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_gloo_processes_match_one(tmp_path):
    single, ddp = one_and_two_processes(_run, tmp_path)
    worst = max((single[k] - ddp[k]).abs().max().item() for k in single)
    assert worst < 1e-5, f"2-process weights differ from 1-process weights by {worst}"
    moved = max((single[k] - _initial()[k]).abs().max().item() for k in single)
    assert moved > 1e-4, "training did not move the weights, so the comparison would prove nothing"


def _initial():
    set_seed(0)
    return CaptionEncoder(EncoderConfig.tiny()).state_dict()
