"""Data parallelism for arms: an arm trained by the one loop under 2 gloo processes (each a shard of the global pair batch,
negatives gathered across ranks) gets the same weights as in 1 process at the same global batch."""
import pytest
import torch
import torch.distributed as dist

from _dist import one_and_two_processes, spawn_gloo
from captionbert.adapters import Arm, PairLoss, grammar_pairs, train_arm
from captionbert.core import set_seed
from captionbert.data import collate, load_tokenizer
from captionbert.encoder import CaptionEncoder, EncoderConfig
from captionbert.loop import TrainConfig

CFG = TrainConfig.smoke(name="arm", max_steps=6, batch_size=16, lr=1e-2, warmup_steps=2, eval_every=1000, ckpt_every_steps=1000)


def _arm():
    return Arm("paraphrase", 64, 2, 8, seed=3)


def _run(folder):
    set_seed(0)
    backbone = CaptionEncoder(EncoderConfig.tiny()).eval()
    arm = _arm()
    train_arm(backbone, arm, grammar_pairs("paraphrase", n=64, seed=0), load_tokenizer(), CFG, folder, seed=0, device="cpu")
    return {k: v.detach().clone() for k, v in arm.state_dict().items()}


def test_two_gloo_processes_train_the_same_arm(tmp_path):
    single, ddp = one_and_two_processes(_run, tmp_path)
    worst = max((single[k] - ddp[k]).abs().max().item() for k in single)
    assert worst < 1e-5, f"2-process arm weights differ from 1-process arm weights by {worst}"
    init = _arm().state_dict()
    moved = min((single[f"up.{i}.weight"] - init[f"up.{i}.weight"]).abs().max().item() for i in range(2))
    assert moved > 1e-4, "training did not move every up-projection, so the comparison would prove nothing"


def _global_batch():
    "A tiny encoder and one global batch of 8 grammar pairs (16 interleaved rows), the same in every process."
    torch.manual_seed(0)
    enc = CaptionEncoder(EncoderConfig.tiny()).eval()
    tok = load_tokenizer()
    ps = grammar_pairs("paraphrase", n=8, seed=0)
    ids = [x for a, b in zip(ps.a, ps.b) for x in tok([a, b])["input_ids"]]
    return enc, ids, collate(ids, torch.arange(16).numpy())


def _rank_losses(rank, world, out):
    "Each rank's loss on its contiguous shard of the global pair batch, gathered to rank 0."
    enc, ids, gb = _global_batch()
    share = 16 // world
    b = collate(ids[rank * share:(rank + 1) * share], torch.arange(rank * share, (rank + 1) * share).numpy())
    with torch.no_grad(): loss, _ = PairLoss()(enc, b, gb)
    losses = [torch.zeros(()) for _ in range(world)]; dist.all_gather(losses, loss.detach())
    if rank == 0: torch.save(torch.stack(losses), out)


def test_ranks_see_every_negative(tmp_path):
    "The mean of the ranks' losses is the one-process loss over the global batch (not a loss over each shard's pairs alone)."
    spawn_gloo(_rank_losses, 2, str(tmp_path / "l.pt"))
    ranks = torch.load(tmp_path / "l.pt")
    enc, _, gb = _global_batch()
    with torch.no_grad(): one, _ = PairLoss()(enc, gb, gb)
    assert abs(ranks.mean().item() - one.item()) < 1e-5, f"rank losses {ranks.tolist()} do not average to the one-process loss {one.item()}"


def test_pair_loss_refuses_split_pairs():
    torch.manual_seed(0)
    enc = CaptionEncoder(EncoderConfig.tiny()).eval()
    ids = load_tokenizer()(["a dog", "a puppy", "a cat", "a kitten"])["input_ids"]
    bad = collate(ids, torch.tensor([0, 2, 1, 3]).numpy())          # a-sides then b-sides: a shard of it splits pairs
    with pytest.raises(ValueError, match="interleaves"):
        PairLoss()(enc, bad, bad)
