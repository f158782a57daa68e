"""What the workbook writes by hand that a kept library also offers (docs/libraries.md): each piece that stays is pinned
here against the library on a planted input, and the reason it stays is checked where it is a fact about the library.
nbs/15_libraries's Run measures every piece on real data (findings/15_libraries.md)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.linalg as sla
import scipy.stats as sps
import torch

from captionbert import stats as S
from captionbert.alignment import RowEmbeddings, _teacher_moments, _whiten_colour, fit_alignment
from captionbert.gauges import _centered_cov, effective_rank, rankdata, spearman
from captionbert.retrieval import retrieval_metrics
from captionbert.teachers import mean_pool
from captionbert.embed import safetensors_memmap


def _ulps(a: float, b: float) -> float:
    return abs(a - b) / np.spacing(max(abs(a), abs(b)))


def test_spearman_matches_scipy_on_ties():
    """gauges.spearman equals scipy.stats.spearmanr to a few units in the last place on STS-like data (gold scores on a
    0.2 grid, similarities with ties), and its ranks are scipy's average ranks exactly. Catches ranks without tie
    averaging (ordinal, min or dense ranks: the planted input moves the correlation by > 1e-5 under them, checked here)
    and a Pearson of the raw values."""
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 26, 2000) / 5.0                                   # 26 values: heavy ties, as in every STS file
    sims = np.round(gold / 5 + rng.normal(0, 0.3, 2000), 2)                  # rounded: ties on this side too
    ref = sps.spearmanr(sims, gold).statistic
    assert _ulps(spearman(sims, gold), ref) <= 4, (spearman(sims, gold), ref)
    for x in (gold, sims): np.testing.assert_array_equal(rankdata(x), sps.rankdata(x, method="average"))
    for wrong in ("ordinal", "min", "dense"):                                # the input tells tie rules apart
        r = np.corrcoef(sps.rankdata(sims, method=wrong), sps.rankdata(gold, method=wrong))[0, 1]
        assert abs(r - ref) > 1e-5, wrong                                   # 1e-5: some 1e11 ulps
    assert abs(np.corrcoef(sims, gold)[0, 1] - ref) > 1e-5                  # ... and Pearson of the raw values


def test_centered_cov_is_torch_cov_bit_for_bit():
    """gauges._centered_cov (now torch.cov) equals the hand formula it replaced, bit for bit, so effective ranks did not
    move; alignment's covariance, kept by hand, equals torch.cov too. Catches torch.cov on x instead of x.T (an [N, N]
    matrix), correction=0 (divides by N), a lost [D, D] shape for one column, and a torch whose reduction order changed
    (it would move every effective rank by an ulp)."""
    g = torch.Generator().manual_seed(0)
    for n, d in ((2, 3), (3, 1), (257, 31), (1000, 96), (40, 200)):
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * 7 + 3
        xc = x - x.mean(0, keepdim=True)
        assert torch.equal(_centered_cov(x), xc.T @ xc / (n - 1)), (n, d)
    x = torch.randn(500, 24, generator=g, dtype=torch.float64)
    xc = x - x.mean(0, keepdim=True); c = xc.T @ xc / 499
    assert effective_rank(x) == float(torch.trace(c) ** 2 / (c * c).sum())
    assert torch.equal(_teacher_moments(x, torch.arange(500), "t")[1], torch.cov(x.T))   # alignment keeps the hand formula: the same numbers


def test_wilson_matches_scipy():
    """stats.wilson95 equals scipy's Wilson interval (binomtest(k, n).proportion_ci(method='wilson')) within 1e-8 for
    every whole count (the gap is Z95 written to 7 digits), and scipy refuses the half counts ties give, which is why
    ours stays. Catches a Wald interval, z = 1.96 (gaps of 1e-5), and a lost z^2/4n^2 term."""
    worst = 0.0
    for n in range(1, 41):
        for k in range(n + 1):
            ci = sps.binomtest(k, n).proportion_ci(0.95, method="wilson")
            lo, hi = S.wilson95(k / n, n)
            worst = max(worst, abs(lo - ci.low), abs(hi - ci.high))
    assert worst < 1e-8, worst
    with pytest.raises(TypeError): sps.binomtest(2.5, 5)                    # a tie counted half: scipy has no interval for it


def test_bootstrap_matches_scipy_draw_for_draw():
    """stats' unit bootstrap draws exactly what scipy.stats.bootstrap (paired, percentile, the same integer seed) draws
    when given per-unit totals; its intervals, single and paired, are exactly the .025 and .975 quantiles of scipy's
    bootstrap distribution, and within 1e-12 of scipy's interval (scipy asks for the (1 - .95)/2 = .025000000000000022
    quantile: the last digit or two). Catches resampling reads instead of units, another generator call (choice, a
    loop of draws), another quantile rule, and paired draws that differ between the two models."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 6, 150)                                          # 150 units of 1..5 reads each
    groups = np.repeat(np.arange(150), sizes)
    a = (rng.random(len(groups)) < 0.6).astype(float); b = (rng.random(len(groups)) < 0.5).astype(float)
    (sa, na, sb, nb), U = S.unit_totals(a, np.ones_like(a), b, np.ones_like(b), groups=groups)
    mean = lambda s, n, axis=-1: s.sum(axis) / n.sum(axis)
    for seed in (0, 11):
        ref = sps.bootstrap((sa, na), mean, paired=True, vectorized=True, method="percentile", n_resamples=999, rng=seed)
        np.testing.assert_array_equal(S._mean(*S._draw([sa, na], U, 999, seed)), ref.bootstrap_distribution)
        got = S.bootstrap_interval(a, groups=groups, n_boot=999, seed=seed)
        assert got == tuple(np.quantile(ref.bootstrap_distribution, [0.025, 0.975])), got
        np.testing.assert_allclose(got, ref.confidence_interval, rtol=0, atol=1e-12)
        ref = sps.bootstrap((sa, na, sb, nb), lambda sa, na, sb, nb, axis=-1: mean(sa, na, axis) - mean(sb, nb, axis), paired=True,
                            vectorized=True, method="percentile", n_resamples=999, rng=seed)
        got = S.paired_interval(a, b, groups=groups, n_boot=999, seed=seed)["ci95"]
        assert got == tuple(np.quantile(ref.bootstrap_distribution, [0.025, 0.975])), got
        np.testing.assert_allclose(got, ref.confidence_interval, rtol=0, atol=1e-12)
    assert S.bootstrap_interval(a, groups=groups, n_boot=999) != S.bootstrap_interval(a, n_boot=999)   # units, not reads, are drawn


def test_procrustes_matches_scipy_where_unique_and_reaches_where_scipy_cannot():
    """alignment.fit_alignment's rotation equals scipy.linalg.orthogonal_procrustes on the whitened fit rows (a planted
    input whose cross-covariance has distinct, non-zero singular values, so the rotation is unique), and it fits maps
    between different widths, which scipy refuses. Catches a transposed rotation (V U^T), the SVD of zr^T zs, and
    U S V^T in place of U V^T."""
    g = torch.Generator().manual_seed(0)
    n, d = 400, 16
    xs = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    xr = xs @ q + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    rows = list(range(n))
    m = fit_alignment(RowEmbeddings.full(xs), RowEmbeddings.full(xr), rows)
    ids = torch.arange(n)
    (mu_s, cs), (mu_r, cr) = _teacher_moments(xs, ids, "s"), _teacher_moments(xr, ids, "r")
    zs, zr = (xs - mu_s) @ _whiten_colour(cs, m.eps)[0], (xr - mu_r) @ _whiten_colour(cr, m.eps)[0]
    sv = torch.linalg.svdvals(zs.T @ zr)
    assert sv.min() > 1e-3 * sv.max() and (sv[:-1] - sv[1:]).min() > 1e-6 * sv.max()   # the planted problem has one answer
    R, _ = sla.orthogonal_procrustes(zs.numpy(), zr.numpy())
    assert np.abs(m.rotation.numpy() - R).max() < 1e-10
    narrow = fit_alignment(RowEmbeddings.full(xs[:, :8].contiguous()), RowEmbeddings.full(xr), rows)   # 8 -> 16 wide
    assert narrow.rotation.shape == (8, 16)
    torch.testing.assert_close(narrow.rotation @ narrow.rotation.T, torch.eye(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="shapes"): sla.orthogonal_procrustes(zs[:, :8].numpy(), zr.numpy())


def test_whitening_matches_scipy_fractional_power():
    """alignment._whiten_colour's Σ^-1/2 and Σ^1/2 equal scipy.linalg.fractional_matrix_power of the same ridged covariance
    (the ridge on the clamped eigenvalues, as the fit applies it) to 1e-9, and are each other's inverse. Catches a ridge
    that is not relative to the mean eigenvalue, V diag V^T written V^T diag V, and square roots swapped."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 24, generator=g, dtype=torch.float64) @ torch.randn(24, 24, generator=g, dtype=torch.float64)
    c = torch.cov(x.T); eps = 1e-5
    w, col = _whiten_colour(c, eps)
    lam, v = torch.linalg.eigh(c); lam = lam.clamp_min(0) + eps * lam.clamp_min(0).mean()
    ridged = ((v * lam) @ v.T).numpy()
    assert np.abs(w.numpy() - np.real(sla.fractional_matrix_power(ridged, -0.5))).max() < 1e-9
    assert np.abs(col.numpy() - np.real(sla.fractional_matrix_power(ridged, 0.5))).max() < 1e-9
    torch.testing.assert_close(w @ col, torch.eye(24, dtype=torch.float64))


def test_retrieval_matches_pytrec_eval_without_ties():
    """retrieval.retrieval_metrics equals pytrec_eval (mteb's retrieval backend) on R@1, R@5 (trec's success@k) and mAP
    when no two scores tie, even at float32 (trec_eval keeps scores as float32 and breaks ties by document id); with a
    planted tie ours ranks the irrelevant row first (pessimistic) and reads lower. Catches optimistic or id-ordered ties,
    the query left in its own gallery, and AP averaged over the retrieved relevant rows instead of all of them."""
    pytrec_eval = pytest.importorskip("pytrec_eval")
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(30), 4)
    x = rng.normal(size=(30, 8))[groups] + 0.9 * rng.normal(size=(120, 8))
    def trec(x):
        u = x / np.linalg.norm(x, axis=1, keepdims=True); s = u @ u.T; n = len(u)
        run = {f"q{i}": {f"d{j}": float(s[i, j]) for j in range(n) if j != i} for i in range(n)}
        qrels = {f"q{i}": {f"d{j}": 1 for j in range(n) if j != i and groups[j] == groups[i]} for i in range(n)}
        r = pytrec_eval.RelevanceEvaluator(qrels, {"success.1,5", "map"}).evaluate(run)
        return {k: float(np.mean([v[m] for v in r.values()])) for k, m in (("r@1", "success_1"), ("r@5", "success_5"), ("map", "map"))}, s
    want, s = trec(x)
    for i, row in enumerate(s.astype(np.float32)):                           # no two scores of one query tie, even at float32
        assert len(np.unique(np.delete(row, i))) == len(row) - 1, i
    got = retrieval_metrics(x, groups.tolist())
    for k in want: assert abs(got[k] - want[k]) < 1e-12, (k, got[k], want[k])
    y = x.copy(); y[4] = y[1]                                                # row 4 (group 1) copies row 1 (group 0): ties
    want, _ = trec(y); got = retrieval_metrics(y, groups.tolist())
    assert got["map"] < want["map"] - 1e-6 and got["r@1"] <= want["r@1"], (got, want)


def test_mean_pool_is_sentence_transformers_pooling():
    """teachers.mean_pool equals sentence-transformers' Pooling (mode 'mean') bit for bit, padded rows and an all-padding
    row included (ours stays because sentence-transformers is the optional `doors` extra and the teachers path must not
    need it). Catches dividing by the padded length, counting padding tokens, and NaN on an all-padding row."""
    Pooling = pytest.importorskip("sentence_transformers.models").Pooling
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 7, 5, generator=g)
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [1] + [0] * 6, [0] * 7])
    st = Pooling(5, pooling_mode="mean")({"token_embeddings": h, "attention_mask": mask})["sentence_embedding"]
    assert torch.equal(mean_pool(h, mask), st)
    assert torch.equal(mean_pool(h, mask)[3], torch.zeros(5))


def test_cls_pooling_is_sentence_transformers_cls():
    """A teacher read with ':cls' gives what sentence-transformers gives for the same transformer under a CLS Pooling
    (how a BGE-style model is served), to float noise of the batching. Catches a reader that mean-pools every view, reads
    the last real token, or reads another layer than the last."""
    st = pytest.importorskip("sentence_transformers")
    from captionbert.data import bundled_minilm_path
    from captionbert.teachers import load_teachers, parse_roster
    mini = str(bundled_minilm_path())
    texts = ["a dog runs along the beach .", "two children in red play football on a wide green field", "a man", "a black and white cat sleeps"]
    model = st.SentenceTransformer(modules=[st.models.Transformer(mini), st.models.Pooling(384, pooling_mode="cls")], device="cpu")
    want = model.encode(texts, convert_to_tensor=True, normalize_embeddings=False, batch_size=3)
    (group,) = load_teachers(parse_roster([f"hf:{mini}:cls", f"hf:{mini}:mean"]), device="cpu", precision="fp32")
    got = group.encode(texts, batch_size=2)
    assert (got["model-cls"] - want).abs().max() < 1e-5, (got["model-cls"] - want).abs().max()
    assert (got["model"] - want).abs().max() > 0.1                       # the mean view is not the CLS vector


def test_safetensors_memmap_equals_the_library_without_a_copy(tmp_path):
    """embed.safetensors_memmap reads what safetensors' own numpy loader reads, bit for bit, for each dtype it takes,
    but as a memory map (the loader copies the whole tensor into RAM: findings/15_libraries.md, memmap.rss_*).
    Catches a wrong data offset (8 + header + start), a wrong dtype table, and a copy where a map was meant."""
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng(0)
    t = {"f32": rng.standard_normal((33, 5)).astype(np.float32), "f16": rng.standard_normal((7, 3)).astype(np.float16),
         "i64": rng.integers(-9, 9, (11,)), "f64": rng.standard_normal((2, 2, 2))}
    p = tmp_path / "t.safetensors"; save_file(t, str(p))
    ref = load_file(str(p))
    for k in t:
        got = safetensors_memmap(p, k)
        assert isinstance(got, np.memmap) and got.dtype == ref[k].dtype and got.shape == ref[k].shape, k
        np.testing.assert_array_equal(got, ref[k])


def test_datasets_cache_key_misses_a_code_change_that_stage_hash_sees(tmp_path):
    """Why the token store keeps its own key: datasets' fingerprint (Hasher, what `Dataset.map` caches by) hashes an
    imported function by its name, so a changed tokenize body reuses a stale cache, while core.stage_hash (what
    token_store_key names) changes. Catches a stage_hash that hashed qualified names only, as dill does."""
    out = []
    for v in (1, 2):
        (tmp_path / "libmod.py").write_text(f"def tokenize(t, texts, n):\n    return [t(x)['input_ids'][:n - {v}] for x in texts]\n")
        code = textwrap.dedent(f"""
            import sys; sys.path.insert(0, {str(tmp_path)!r})
            from datasets.fingerprint import Hasher
            from captionbert.core import stage_hash
            from libmod import tokenize
            print(Hasher.hash(tokenize), stage_hash(tokenize))""")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})   # no stale .pyc between the two versions
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(r.stdout.split())
    assert out[0][0] == out[1][0], out                                       # datasets: the same key for different code
    assert out[0][1] != out[1][1], out                                       # stage_hash: a new key
