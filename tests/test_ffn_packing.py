"""Both ways an unrouted FFN meets padding: packed real tokens, or every position (CaptionEncoder.pack_ffn_above, a
speed choice). Catches a path that lets padded rows reach real tokens or the pooled vector, a threshold read the wrong
way, a routed FFN that stops packing, and a checkpointed block recomputed on the other path than its forward took."""
import torch
import fastcore.test as ft

from captionbert.encoder import PACK_FFN_ABOVE, CaptionEncoder, EncoderConfig


def test_both_ways_give_the_real_tokens_the_same_states_and_gradients():
    test_eq, test_close = ft.test_eq, ft.test_close     # (bound here: pytest would collect them at module level)
    def _ffn_inputs(model, ids, am, backward=False):
        "The shape each block's FFN was given in one forward (packed [T, D] or every position [B, L, D])."
        seen, hooks = [], [b.ffn.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape))) for b in model.blocks]
        try:
            o = model(ids, am)
            if backward: (o.last_hidden_state[am.bool()].sum() + o.pooler_output.sum()).backward()
        finally:
            for h in hooks: h.remove()
        return o, seen
    def _both_ways(model, pids, pam):
        "Real-token states, pooled vectors and weight gradients with the FFN packed (threshold 0) and on every position (threshold 1)."
        out = []
        for share in (0.0, 1.0):
            model.pack_ffn_above = share; model.zero_grad()
            o, seen = _ffn_inputs(model, pids, pam, backward=True)
            out.append((o.last_hidden_state[pam.bool()].detach(), o.pooler_output.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, seen, o.last_hidden_state[~pam.bool()].detach()))
        model.pack_ffn_above = PACK_FFN_ABOVE
        return out
    torch.manual_seed(0); pk = CaptionEncoder(EncoderConfig.tiny()).double().eval()     # eval: no dropout draws to tell apart
    pids = torch.randint(1000, 2000, (6, 12)); pam = torch.ones(6, 12, dtype=torch.long); pam[1, 9:] = 0; pam[3, 7:] = 0   # 11% padded
    (h0, p0, g0, s0, x0), (h1, p1, g1, s1, x1) = _both_ways(pk, pids, pam)
    T, D = int(pam.sum()), pk.config.hidden
    test_eq((set(s0), set(s1)), ({(T, D)}, {(6, 12, D)}))                    # each way really ran: packed real tokens, then every position
    test_close(h0, h1, eps=1e-12); test_close(p0, p1, eps=1e-12)             # the real tokens and the pooled vectors: the same
    test_eq(sorted(g0), sorted(g1)); assert all(torch.allclose(g0[n], g1[n], rtol=0, atol=1e-12) for n in g0)   # every gradient: the same
    assert (x0 - x1).abs().max() > 1e-3                                      # padded positions differ (the FFN reached them one way only): never read
    pk.pack_ffn_above = 0.2
    test_eq(set(_ffn_inputs(pk, pids, pam)[1]), {(6, 12, D)})                # 11% padded, at most pack_ffn_above: every position
    pam2 = pam.clone(); pam2[0, 3:] = 0                                      # 24% padded: packed
    test_eq(set(_ffn_inputs(pk, pids, pam2)[1]), {(int(pam2.sum()), D)})
    pk.pack_ffn_above = PACK_FFN_ABOVE; test_eq(set(_ffn_inputs(pk, pids, pam)[1]), {(T, D)})   # the default: packed wherever there is padding
    pam3 = pam.clone(); pam3[2] = 0                                           # an empty row, both ways: the real tokens and the pooled vectors alike
    (h0, p0, *_), (h1, p1, *_) = _both_ways(pk, pids, pam3); test_close(h0, h1, eps=1e-12); test_close(p0, p1, eps=1e-12); test_eq(p0[2].abs().sum().item(), 0.0)
    # a routed FFN packs whatever the padding (its routing is read per real token)
    torch.manual_seed(0); rt = CaptionEncoder(EncoderConfig.tiny(ffn="anchored")).double().eval()
    test_eq(set(_ffn_inputs(rt, pids, pam)[1]), {(T, D)})
    # gradient checkpointing recomputes each block on the path its forward took, even when a later forward took the other one
    torch.manual_seed(0); ck = CaptionEncoder(EncoderConfig.tiny(gradient_checkpointing=True)).train(); ck.pack_ffn_above = 0.2
    light, heavy = ck(pids, pam).pooler_output.sum(), ck(pids, pam2).pooler_output.sum()   # every position, then packed
    (light + heavy).backward()                                               # the code that read the path from the block at recompute time failed here
    assert all(p.grad is not None for p in ck.parameters() if p.requires_grad)
