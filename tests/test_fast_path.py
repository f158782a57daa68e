"""The GPU fast path, each part against the plain path on this CPU (issue 26.3): Adam fused (TrainStep's own step, the
fused kernel forced, against the for-each one forced), bf16 autocast with fp32 master weights, SDPA with no materialised mask where a batch has no
padding. Unpadded attention is 01b's (`unpad_attention`), the compile flag tests/test_chunked.py's. Each equality shows
its path was taken, so two runs of the plain path cannot pass it."""
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

import captionbert.loop as loop_module
from captionbert.core import set_seed
from captionbert.data import load_tokenizer
from captionbert.encoder import CaptionEncoder, EncoderConfig
from captionbert.loop import ConsensusLoss, TokenizedCorpus, TrainConfig, TrainStep
from captionbert.sources import SceneGrammar

CPU = torch.device("cpu")


def _setup(dtype=torch.float32):
    corpus = TokenizedCorpus.from_texts(load_tokenizer(), list(SceneGrammar(n=64, seed=3)))
    targets = F.normalize(torch.randn(len(corpus), 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1).to(dtype)
    return corpus, targets


def _steps(fused: bool, precision: str = "fp32", n: int = 3):
    "Weights, losses and gradients of the first step after n TrainSteps of a seeded tiny encoder (lr_scales on, so Adam has two groups)."
    corpus, targets = _setup()
    set_seed(0)
    model = CaptionEncoder(EncoderConfig.tiny(dropout=0.0))
    cfg = TrainConfig.smoke(batch_size=16, warmup_steps=1, lr_scales=(("head.0.weight", 0.5),))
    real_adam = torch.optim.Adam
    adam = lambda *a, **k: real_adam(*a, **{**k, "fused": fused})        # TrainStep's own call, the fused kernel forced on or off
    with mock.patch.object(loop_module.torch.optim, "Adam", adam):
        step = TrainStep(model, cfg, CPU, precision)
    seen = []                                                              # the dtype the step's forward computes its projections in
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    step.forward_dtypes = seen
    losses, grads = [], None
    for i in range(n):
        b = corpus.batch(np.arange(16 * i, 16 * (i + 1)))
        if grads is None:                                                  # the first step's gradient, taken by the step's own backward
            step.backward(model, ConsensusLoss(targets), b, b, i)
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            step.opt.zero_grad(set_to_none=True)
        loss, _, _, _ = step(model, ConsensusLoss(targets), b, b, i)        # TrainStep.__call__: backward, unscale, clip, Adam, schedule
        losses.append(float(loss.detach()))
    return model, step, losses, grads


def test_fused_adam_steps_the_weights_the_plain_adam_does():
    "Fused Adam (TrainStep's choice on CUDA and CPU) against the for-each Adam: the same weights after 3 steps with two lr groups, to 1e-6."
    plain, sp, _, _ = _steps(False)
    fused, sf, _, _ = _steps(True)
    assert sp.opt.defaults["fused"] in (None, False) and sf.opt.defaults["fused"] is True      # each path taken
    assert [g["lr"] for g in sf.opt.param_groups] == [g["lr"] for g in sp.opt.param_groups] and len(sp.opt.param_groups) == 2
    worst = max((a - b).abs().max().item() for a, b in zip(plain.state_dict().values(), fused.state_dict().values()) if a.is_floating_point())
    assert worst < 1e-6, worst
    moved = max((a - b).abs().max().item() for a, b in zip(plain.state_dict().values(), CaptionEncoder(EncoderConfig.tiny()).state_dict().values()) if a.is_floating_point())
    assert moved > 1e-4, "nothing trained: the equality compares two untouched models"


def test_train_step_takes_fused_adam_on_cuda_and_cpu():
    "TrainStep's own choice, read off the optimizer it builds: fused on CUDA and on a CPU (loop.FUSED_ADAM_DEVICES), the for-each Adam elsewhere (the CUDA and MPS steps are built with the kernel disabled, so no GPU is needed)."
    real_adam, asked = torch.optim.Adam, []
    def recording(*a, **k): asked.append(k.get("fused")); return real_adam(*a, **{**k, "fused": False})
    set_seed(0); model = CaptionEncoder(EncoderConfig.tiny())
    with mock.patch.object(loop_module.torch.optim, "Adam", recording), mock.patch.object(loop_module.torch.amp, "GradScaler", lambda *a, **k: None):
        TrainStep(model, TrainConfig.smoke(), torch.device("cuda"), "bf16"); TrainStep(model, TrainConfig.smoke(), CPU, "fp32")
        TrainStep(model, TrainConfig.smoke(), torch.device("mps"), "fp32")
    assert asked == [True, True, False], asked


def test_bf16_autocast_keeps_fp32_master_weights_and_the_fp32_gradient_to_its_precision():
    "bf16 autocast: the weights and their gradients stay fp32; the loss and the gradient agree with fp32's to bf16's precision (loss 1%, gradient cosine 0.999), and differ (autocast ran)."
    m32, s32, l32, g32 = _steps(False, "fp32", n=1)
    m16, s16, l16, g16 = _steps(False, "bf16", n=1)
    assert all(p.dtype == torch.float32 for p in m16.parameters()) and all(g.dtype == torch.float32 for g in g16.values())
    assert set(s16.forward_dtypes) == {torch.bfloat16} and set(s32.forward_dtypes) == {torch.float32}, (s16.forward_dtypes, s32.forward_dtypes)   # bf16, not fp16
    assert l16[0] != l32[0], "bf16 gave the fp32 loss bit for bit: autocast did not run"
    assert abs(l16[0] - l32[0]) / abs(l32[0]) < 0.01, (l16, l32)
    a, b = torch.cat([g.flatten() for g in g32.values()]), torch.cat([g16[k].flatten() for k in g32])
    cos = F.cosine_similarity(a, b, dim=0).item()
    assert cos > 0.999, cos


def test_sdpa_takes_no_mask_where_a_batch_has_no_padding():
    "A batch with no padding reaches SDPA with attn_mask=None (its fast kernels); a padded one with the boolean key mask, and its real rows equal the unpadded rows' outputs."
    seen = []
    real = F.scaled_dot_product_attention
    def spy(*a, **k): seen.append(k.get("attn_mask")); return real(*a, **k)
    set_seed(0)
    m = CaptionEncoder(EncoderConfig.tiny()).eval()
    full = torch.tensor([[101, 2023, 2003, 102], [101, 1037, 3899, 102]])
    padded = torch.tensor([[101, 2023, 2003, 102, 0, 0], [101, 1037, 3899, 102, 0, 0]])
    with mock.patch.object(F, "scaled_dot_product_attention", spy), torch.no_grad():
        a = m(full); n_full = len(seen)
        b = m(padded)
    assert n_full == 2 and all(x is None for x in seen[:n_full]), seen[:n_full]
    assert all(x is not None and x.dtype == torch.bool for x in seen[n_full:]), seen[n_full:]
    assert (a.pooler_output - b.pooler_output).abs().max() < 1e-5
