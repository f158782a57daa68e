"""A step in chunks (TrainConfig.chunk_rows) takes the whole batch's gradient: the consensus loss by rows (one forward), the
pair loss by cached representation gradients (GradCache, two forwards); under 2 gloo processes; across a resume. A loss that
declares no chunking, or a model with an auxiliary loss in its backward, is refused. Each equality has a planted wrong
chunking beside it that it tells apart, so the tolerance is not one that anything passes."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _dist import one_and_two_processes, spawn_gloo
from captionbert.adapters import PairLoss, PairPlan, grammar_pairs
from captionbert.core import GuardError, RunDir, set_seed
from captionbert.data import load_tokenizer
from captionbert.encoder import CaptionEncoder, EncoderConfig
from captionbert.sources import SceneGrammar
from captionbert.loop import BatchPlan, ConsensusLoss, TokenizedCorpus, TrainConfig, TrainStep, train

CFG = TrainConfig.smoke(max_steps=6, batch_size=16, warmup_steps=2, eval_every=1000, ckpt_every_steps=1000)


def _consensus(dtype=torch.float64, n=200):
    corpus = TokenizedCorpus.from_texts(load_tokenizer(), list(SceneGrammar(n=n, seed=3)))
    targets = F.normalize(torch.randn(len(corpus), 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1).to(dtype)
    return corpus, targets


def _grads(model, loss_fn, batch, chunk_rows):
    "The parameters' gradient after TrainStep.backward of one batch, whole (chunk_rows=None) or in chunks."
    model.zero_grad(set_to_none=True)
    step = TrainStep(model, TrainConfig.smoke(chunk_rows=chunk_rows), torch.device("cpu"), "fp32")
    loss, metrics, _ = step.backward(model, loss_fn, batch, batch, 0)
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(a, b):
    "The largest difference of two gradients (or state dicts), each tensor's relative to its own largest entry (fp32 sums in another order)."
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)).item() for k in a if a[k].is_floating_point())


class _RowsClaimedWrongly:
    "A planted fault: in-batch negatives (rows meet in the loss) declared row-separable, so a chunked step drops the cross-chunk negatives."
    chunking = "rows"
    def __call__(self, model, batch, global_batch):
        out = model(batch.input_ids, batch.attention_mask).pooler_output
        return F.cross_entropy(out @ out.roll(1, 0).T / 0.05, torch.arange(len(out))), {}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_consensus_loss_in_chunks_takes_the_batch_gradient(dtype, tol):
    corpus, targets = _consensus(dtype)
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny()).to(dtype)
    batch = corpus.batch(np.arange(24))
    loss_fn = ConsensusLoss(targets)
    whole_loss, whole_m, whole = _grads(model, loss_fn, batch, None)
    for chunk in (5, 8, 23):                                   # uneven last chunks too
        loss, m, g = _grads(model, loss_fn, batch, chunk)
        assert _worst(whole, g) < tol, f"chunk_rows={chunk}: gradient differs by {_worst(whole, g)} ({dtype})"
        assert abs(loss - whole_loss) < tol and all(abs(m[k] - whole_m[k]) < tol for k in whole_m), (loss, whole_loss, m, whole_m)
    assert max(v.abs().max().item() for v in whole.values()) > 1e-3, "no gradient to compare"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_pair_loss_in_chunks_uses_gradcache_and_the_planted_row_claim_is_caught(dtype, tol):
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny()).to(dtype)
    plan = PairPlan(load_tokenizer(), grammar_pairs("paraphrase", n=32, seed=0), 12, seed=0)     # 12 pairs: 24 rows
    batch = plan(0)
    _, _, whole = _grads(model, PairLoss(), batch, None)
    _, _, cached = _grads(model, PairLoss(), batch, 5)         # odd chunks split pairs: GradCache does not care
    assert _worst(whole, cached) < tol, f"GradCache gradient differs by {_worst(whole, cached)} ({dtype})"
    _, _, planted_whole = _grads(model, _RowsClaimedWrongly(), batch, None)
    _, _, planted = _grads(model, _RowsClaimedWrongly(), batch, 6)      # the same loss, wrongly chunked by rows
    assert _worst(planted_whole, planted) > 1e3 * tol, f"the planted row claim moved the gradient by only {_worst(planted_whole, planted)}: the check cannot fail"


def test_gradcache_reruns_each_chunk_with_its_first_pass_dropout():
    "With dropout on, each chunk's second forward (with its graph) must draw the masks of its first (without): the RNG state is restored."
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny(dropout=0.3))
    batch = PairPlan(load_tokenizer(), grammar_pairs("paraphrase", n=16, seed=0), 6, seed=0)(0)     # 12 rows
    seen = []

    class Recording(PairLoss):
        def represent(self, model, batch):
            out = super().represent(model, batch); seen.append(out.detach().clone()); return out

    _grads(model, Recording(), batch, 4)
    first, second = seen[:3], seen[3:]
    assert len(second) == 3 and all(torch.equal(a, b) for a, b in zip(first, second)), "a chunk's re-run drew other dropout masks"
    assert not torch.equal(first[0], model.eval()(batch[0:4].input_ids, batch[0:4].attention_mask).pooler_output.float()), \
        "dropout did not change the output, so the check would prove nothing"


def test_chunking_refuses_what_it_cannot_make_exact():
    corpus, targets = _consensus(torch.float32)
    batch = corpus.batch(np.arange(8))

    class Undeclared:
        def __call__(self, model, batch, global_batch): return model(batch.input_ids, batch.attention_mask).pooler_output.pow(2).mean(), {}

    with pytest.raises(GuardError, match="declares no `chunking`"):
        _grads(CaptionEncoder(EncoderConfig.tiny()), Undeclared(), batch, 4)
    _grads(CaptionEncoder(EncoderConfig.tiny()), Undeclared(), batch, None)          # the same loss whole is fine
    binding = CaptionEncoder(EncoderConfig.tiny(position="binding", lookup_layer=1, lookup_head=0, out_dim=48))
    with pytest.raises(GuardError, match="auxiliary loss"):
        _grads(binding, ConsensusLoss(targets), batch, 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_rows"): TrainConfig.smoke(chunk_rows=bad)


def _apart(a, b):
    "The largest absolute difference of two state dicts' float tensors (weights after Adam steps: test_distributed's measure)."
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point())


def _run(folder, chunk_rows=3, stop_at=None, resume=False):
    corpus, targets = _consensus(torch.float32)
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny())
    cfg = TrainConfig.smoke(max_steps=6, batch_size=16, warmup_steps=2, eval_every=1000, ckpt_every_steps=3, chunk_rows=chunk_rows)
    train(model, BatchPlan(corpus, np.arange(200), cfg.batch_size, seed=0), ConsensusLoss(targets), cfg, RunDir(folder),
          {"corpus": "scene-grammar-3"}, resume=resume, stop_at=stop_at, device="cpu", progress=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run_whole(folder): return _run(folder, chunk_rows=None)


def test_two_gloo_processes_in_chunks_match_one_whole(tmp_path):
    whole = _run_whole(tmp_path / "whole")
    single, ddp = one_and_two_processes(_run, tmp_path)       # chunk_rows=3: each process's share of 8 rows in chunks of 3, 3, 2
    for name, w in (("1 process in chunks", single), ("2 processes in chunks", ddp)):
        worst = _apart(whole, w)
        assert worst < 1e-5, f"{name}: weights differ from the whole-batch run by {worst}"
    init = CaptionEncoder(EncoderConfig.tiny()).state_dict()
    assert _apart(whole, init) > 1e-4, "training did not move the weights, so the comparison would prove nothing"


def test_a_chunked_run_resumes_exactly_and_may_change_its_chunks(tmp_path):
    straight = _run(tmp_path / "straight")
    _run(tmp_path / "cut", stop_at=3)
    resumed = _run(tmp_path / "cut", resume=True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), f"resumed chunked run differs by {_apart(straight, resumed)}"
    _run(tmp_path / "other", stop_at=3)
    other = _run(tmp_path / "other", chunk_rows=5, resume=True)         # a card of another size: the chunks change, the run does not
    assert _apart(straight, other) < 1e-5, _apart(straight, other)
    log = (tmp_path / "other" / "resumes.jsonl").read_text()
    assert "chunk_rows" in log, log


def test_a_compiled_run_trains_the_eager_weights(tmp_path):
    "TrainConfig.compile (here the aot_eager backend: the graph capture and its autograd, no C++ compiler) trains the weights eager training does, and saves them under the eager names."
    corpus, targets = _consensus(torch.float32)
    from torch._dynamo.utils import counters
    out = {}
    counters.clear()
    for name, backend in (("eager", None), ("compiled", "aot_eager")):
        set_seed(0)
        model = CaptionEncoder(EncoderConfig.tiny())
        cfg = TrainConfig.smoke(max_steps=4, batch_size=16, warmup_steps=1, eval_every=1000, ckpt_every_steps=1000, compile=backend)
        train(model, BatchPlan(corpus, np.arange(200), cfg.batch_size, seed=0), ConsensusLoss(targets), cfg, RunDir(tmp_path / name),
              {"corpus": "scene-grammar-3"}, resume=False, device="cpu", progress=False)
        out[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        captured = sum(counters["stats"].values())
        assert (captured > 0) == (backend is not None), f"{name}: dynamo counters {dict(counters['stats'])}: a compile flag that compiled nothing passes the equality"
    assert out["eager"].keys() == out["compiled"].keys(), "compiling renamed the state dict (an _orig_mod. prefix breaks checkpoints and exports)"
    assert _apart(out["eager"], out["compiled"]) < 1e-5, _apart(out["eager"], out["compiled"])
    assert _apart(out["eager"], CaptionEncoder(EncoderConfig.tiny()).state_dict()) > 1e-4, "nothing trained"
    with pytest.raises(ValueError, match="not a torch.compile backend"): TrainConfig.smoke(compile="inductr")


def test_an_unpadded_run_trains_the_padded_weights(tmp_path):
    "TrainConfig.unpad_attention reaches the model (the jagged path is taken in training) and trains the weights the padded path does, to fp32 rounding; a model without the path refuses the flag."
    from unittest import mock
    import captionbert.encoder as encoder_module
    corpus, targets = _consensus(torch.float32)
    out, calls = {}, {}
    for unpad in (False, True):
        set_seed(0)
        model = CaptionEncoder(EncoderConfig.tiny(dropout=0.0))
        cfg = TrainConfig.smoke(max_steps=4, batch_size=16, warmup_steps=1, eval_every=1000, ckpt_every_steps=1000, unpad_attention=unpad)
        spy = mock.MagicMock(wraps=encoder_module.jagged_attention)
        with mock.patch.object(encoder_module, "jagged_attention", spy):
            train(model, BatchPlan(corpus, np.arange(200), cfg.batch_size, seed=0), ConsensusLoss(targets), cfg, RunDir(tmp_path / str(unpad)),
                  {"corpus": "scene-grammar-3"}, resume=False, device="cpu", progress=False)
        out[unpad], calls[unpad] = {k: v.detach().clone() for k, v in model.state_dict().items()}, spy.call_count
        assert model.unpad_attention is unpad
    assert calls[False] == 0 and calls[True] >= 4 * 2, calls           # the flag took the path (4 steps x 2 blocks at least), and only with it
    assert _apart(out[False], out[True]) < 1e-5, _apart(out[False], out[True])
    assert _apart(out[False], CaptionEncoder(EncoderConfig.tiny()).state_dict()) > 1e-4, "nothing trained"
    set_seed(0); ckpt = CaptionEncoder(EncoderConfig.tiny(gradient_checkpointing=True))   # the flag it cannot honour is said, not dropped silently
    with pytest.warns(UserWarning, match="this run's attention is padded"):
        train(ckpt, BatchPlan(corpus, np.arange(200), 16, seed=0), ConsensusLoss(targets), TrainConfig.smoke(max_steps=1, unpad_attention=True),
              RunDir(tmp_path / "ckpt"), {"corpus": "scene-grammar-3"}, resume=False, device="cpu", progress=False)
    with pytest.raises(ValueError, match="unpad_attention is a CaptionEncoder's path"):
        train(torch.nn.Linear(2, 2), BatchPlan(corpus, np.arange(200), 16, seed=0), ConsensusLoss(targets), TrainConfig.smoke(unpad_attention=True),
              RunDir(tmp_path / "linear"), {"corpus": "scene-grammar-3"}, resume=False, device="cpu", progress=False)


def _ddp_share_grads(rank, world, chunk_rows, out):
    "In a gloo group: each process's share of one global batch through DDP and TrainStep.backward in chunks; rank 0 saves the all-reduced gradients."
    corpus, targets = _consensus(torch.float64)
    set_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(CaptionEncoder(EncoderConfig.tiny()).double())
    gb = corpus.batch(np.arange(24)); share = len(gb) // world
    step = TrainStep(model, TrainConfig.smoke(chunk_rows=chunk_rows), torch.device("cpu"), "fp32")
    step.backward(model, ConsensusLoss(targets), gb[rank * share:(rank + 1) * share], gb, 0)
    if rank == 0: torch.save({n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}, out)


def test_two_gloo_processes_in_chunks_take_the_whole_batch_gradient(tmp_path):
    "The gradient itself, not weights after Adam (which is blind to the gradient's scale): 2 processes x chunks of 5 = 1 process whole, fp64."
    corpus, targets = _consensus(torch.float64)
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny()).double()
    _, _, whole = _grads(model, ConsensusLoss(targets), corpus.batch(np.arange(24)), None)
    spawn_gloo(_ddp_share_grads, 2, 5, str(tmp_path / "ddp.pt"))
    ddp = torch.load(tmp_path / "ddp.pt")
    assert ddp.keys() == whole.keys()
    assert _worst(whole, ddp) < 1e-10, f"2 processes in chunks: gradient differs from the whole batch's by {_worst(whole, ddp)}"
    doubled = {k: 2 * v for k, v in ddp.items()}                # a planted scale fault (summed, not averaged, across ranks) is caught
    assert _worst(whole, doubled) > 0.5, _worst(whole, doubled)


def _ddp_pair_grads(rank, world, chunk_rows, out):
    "In a gloo group: each process's share of one pair batch (negatives gathered across ranks) through DDP and GradCache chunks; rank 0 saves the gradients."
    set_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(CaptionEncoder(EncoderConfig.tiny()).double())
    gb = PairPlan(load_tokenizer(), grammar_pairs("paraphrase", n=32, seed=0), 12, seed=0)(0); share = len(gb) // world
    step = TrainStep(model, TrainConfig.smoke(chunk_rows=chunk_rows), torch.device("cpu"), "fp32")
    step.backward(model, PairLoss(), gb[rank * share:(rank + 1) * share], gb, 0)
    if rank == 0: torch.save({n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}, out)


def test_gradcache_under_two_gloo_processes_takes_the_whole_batch_gradient(tmp_path):
    "GradCache with the pair loss's cross-rank negatives (_GatherRows inside from_representations): 2 processes x chunks of 5 = 1 process whole, fp64."
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny()).double()
    _, _, whole = _grads(model, PairLoss(), PairPlan(load_tokenizer(), grammar_pairs("paraphrase", n=32, seed=0), 12, seed=0)(0), None)
    spawn_gloo(_ddp_pair_grads, 2, 5, str(tmp_path / "ddp.pt"))
    ddp = torch.load(tmp_path / "ddp.pt")
    assert _worst(whole, ddp) < 1e-10, f"GradCache under 2 processes: gradient differs from the whole batch's by {_worst(whole, ddp)}"
