"""Published size without published RAM: the token store and the consensus targets are read by row id from memory-mapped
files, so the process's anonymous memory (RssAnon) does not grow with the rows read; and the dry-run plans of v2 / v2b."""
import gc
import json
import pytest
from pathlib import Path
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import save_file

from captionbert.targets import TargetRows
from captionbert.data import TokenStore


pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RssAnon is read from /proc (Linux)")


def rss_anon_mb() -> float:
    "This process's anonymous resident memory (RssAnon in /proc/self/status), in MB."
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"): return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon line in /proc/self/status")


class _Words:
    "A stand-in tokenizer: a fixed 96 ids a caption (cheap, so the test measures reading, not tokenizing)."
    def __len__(self): return 30_522
    def get_vocab(self): return {"[PAD]": 0}
    def __call__(self, texts, **kw): return {"input_ids": [[101] + [1000 + (hash(t) + i) % 20_000 for i in range(94)] + [102] for t in texts]}


def _read_all(get, n, batch=2048, seed=0, base=None):
    "Touch every row once in random batches; the largest RssAnon growth seen over `base` (taken before the store was opened), in MB."
    base, peak = rss_anon_mb() if base is None else base, 0.0
    for rows in np.array_split(np.random.default_rng(seed).permutation(n), n // batch):
        x = get(rows); del x
        peak = max(peak, rss_anon_mb() - base)
    return peak


TOKEN_BUDGET, TARGET_BUDGET = 0.25, 0.1   # the RssAnon growth a reader may show, as a share of the bytes it reads


def _token_growth(tmp_path, open_store=TokenStore.open):
    "RssAnon growth (MB) while reading every row of a 200k-row token store in random batches, and the store's bytes (MB)."
    n = 200_000
    if not (tmp_path / "tokens").exists():
        TokenStore.build((f"caption {i}" for i in range(n)), _Words(), tmp_path / "tokens", chunk=20_000, progress=False)
    gc.collect(); base = rss_anon_mb()                             # before opening: an eager open (np.fromfile) would count
    store = open_store(tmp_path / "tokens")
    data_mb = store.tokens.nbytes / 2**20                          # 200k x 96 uint16 = 36.6 MB of ids
    assert len(store) == n and data_mb > 30
    return _read_all(lambda rows: store.batch(rows[:256]), n, batch=256, base=base), data_mb


def _in_fresh_process(reading, tmp_path):
    """`reading(tmp_path)` run in a new interpreter, its (growth MB, data MB) returned. Each RssAnon reading needs a process
    that has freed nothing yet: in a pytest worker that ran other tests, malloc hands a new 36-205 MB array pages it touched
    before, and RssAnon does not move (an eager loader read as 0.0 MB grown under CI's pytest-xdist)."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; import test_scale as t; "
            f"print(json.dumps(t.{reading.__name__}(Path({str(tmp_path)!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def _lazy_tokens(tmp_path): return _token_growth(tmp_path)
def _eager_tokens(tmp_path): return _token_growth(tmp_path, _EagerTokens.open)
def _lazy_targets(tmp_path): return _target_growth(tmp_path)
def _eager_targets(tmp_path): return _target_growth(tmp_path, _EagerTargets)
def _held_array(tmp_path):
    "The instrument alone: 205 MB held in RAM, and its bytes."
    gc.collect(); base = rss_anon_mb()
    held = np.ones((200_000, 256), np.float32)
    return rss_anon_mb() - base, held.nbytes / 2**20


def test_token_store_reads_200k_rows_without_growing_anonymous_memory(tmp_path):
    grew, data_mb = _in_fresh_process(_lazy_tokens, tmp_path)
    assert grew < TOKEN_BUDGET * data_mb, f"RssAnon grew {grew:.1f} MB while reading {data_mb:.1f} MB of token ids: they are being loaded into RAM"


def _targets(tmp_path, n=200_000, d=256, shard=25_000):
    "200k fp32 targets (205 MB) in 8 memory-mappable shards; their manifest."
    shards = {}
    for k, lo in enumerate(range(0, n, shard)):
        g = torch.Generator().manual_seed(k)
        p = tmp_path / "targets" / f"shard-{k:05d}.safetensors"; p.parent.mkdir(exist_ok=True)
        if not p.exists(): save_file({"targets": torch.randn(shard, d, generator=g), "row_ids": torch.arange(lo, lo + shard)}, str(p))
        shards[f"{k:05d}"] = {"rows": [lo, lo + shard], "n": shard}
    return {"shards": shards, "dim": d}


def _target_growth(tmp_path, reader=TargetRows):
    "RssAnon growth (MB) while reading every target row by id in random batches, and the targets' bytes (MB)."
    manifest = _targets(tmp_path); n, d = 200_000, manifest["dim"]
    gc.collect(); base = rss_anon_mb()                             # before opening: an eager TargetRows (get_tensor per shard) would count
    tr = reader(tmp_path, manifest)
    want = torch.randn(25_000, d, generator=torch.Generator().manual_seed(3))[[7, 11]]
    assert torch.equal(tr[[3 * 25_000 + 7, 3 * 25_000 + 11]], want)                     # row ids, across shards, not positions
    return _read_all(lambda rows: tr[rows], n, base=base), n * d * 4 / 2**20


def test_targets_read_by_row_id_from_memory_mapped_shards(tmp_path):
    grew, data_mb = _in_fresh_process(_lazy_targets, tmp_path)
    assert grew < TARGET_BUDGET * data_mb, f"RssAnon grew {grew:.1f} MB while reading {data_mb:.0f} MB of targets: they are being loaded into RAM"


class _EagerTokens(TokenStore):
    "A planted token loader that holds every row: the store read into anonymous memory when opened."
    @classmethod
    def open(cls, folder):
        store = TokenStore.open(folder); store.tokens = np.array(store.tokens); return store


class _EagerTargets(TargetRows):
    "A planted target loader that holds every row: each shard copied into anonymous memory when opened."
    def __init__(self, folder, manifest):
        super().__init__(folder, manifest); self._vec = [np.array(v) for v in self._vec]


def test_the_budgets_trip_on_loaders_that_hold_every_row(tmp_path):
    "The two budgets above can fail: a reader that holds every row grows past each, on the same rows and the same measure."
    grew, data_mb = _in_fresh_process(_eager_tokens, tmp_path)
    assert grew >= TOKEN_BUDGET * data_mb, f"an eager token loader grew only {grew:.1f} MB of {data_mb:.1f} MB: the budget could not catch it"
    grew, data_mb = _in_fresh_process(_eager_targets, tmp_path)
    assert grew >= TARGET_BUDGET * data_mb, f"an eager target loader grew only {grew:.1f} MB of {data_mb:.0f} MB: the budget could not catch it"


def test_rss_probe_sees_a_loader_that_holds_everything(tmp_path):
    "The instrument can fail: holding the same 205 MB in RAM shows in RssAnon (in a fresh process, as every reading above)."
    grew, held_mb = _in_fresh_process(_held_array, tmp_path)
    assert grew > 0.8 * held_mb, f"RssAnon grew {grew:.1f} MB while {held_mb:.0f} MB were held"


def test_dry_run_plans_v2_and_v2b_on_the_command_line():
    "No network, no GPU: one JSON line each; v2 4.0 epochs of 26,904,576 rows, v2b 62,312 steps on 31,905,616 less the held-out rows, the same maps."
    env = {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    plans = {}
    for p in ("v2", "v2b"):
        out = subprocess.run([sys.executable, "-m", "captionbert.train", "--preset", p, "--dry-run"], capture_output=True, text=True,
                             env=env, timeout=120, check=True).stdout
        assert len(out.strip().splitlines()) == 1, out
        plans[p] = json.loads(out)
    assert (plans["v2"]["steps"], plans["v2"]["rows"], plans["v2"]["epochs"]) == (52_548, 26_904_576, 4.0)
    # v2b trains on its whole range less the gauges' 8,192 rows: the published 62,312 steps are 4.0008 epochs of them
    assert (plans["v2b"]["steps"], plans["v2b"]["rows"], plans["v2b"]["epochs"]) == (62_312, 31_905_616 - 8192, 4.0008)
    assert plans["v2"]["train_range"] == [0, 26_904_576] and plans["v2b"]["train_range"] == [0, 31_905_616]
    assert plans["v2"]["held_out_rows"] == plans["v2b"]["held_out_rows"] == 8192
    assert all(p["stages"][0].startswith("python -m captionbert.consensus tokens --preset published") for p in plans.values())   # rows checked first
    assert all(p["stages"][1].startswith("torchrun ") and " -m captionbert.embed embed " in p["stages"][1] for p in plans.values())
    assert plans["v2"]["batch_size"] == plans["v2b"]["batch_size"] == 2048
    assert plans["v2"]["maps"] == plans["v2b"]["maps"]


def test_token_and_target_rows_that_differ_are_refused():
    "recipe.assert_same_rows: a token store cut short, or one built from other captions, is refused before training."
    import types
    import pytest
    from captionbert.core import GuardError
    from captionbert.recipe import assert_same_rows
    def store(n, fp="abc"):
        lens = np.full(n, 3, dtype=np.int64)
        return TokenStore(np.ones(3 * n, dtype=np.int32), np.concatenate([[0], np.cumsum(lens)]), manifest={"source_fingerprint": fp})
    targets = types.SimpleNamespace(source_fingerprint="abc", n_rows=10, row_ids=np.arange(10), folder="targets")
    assert_same_rows(store(10), targets)                                   # the same rows of the same captions pass
    with pytest.raises(GuardError, match="holds 9 rows but the targets in targets hold 10"):
        assert_same_rows(store(9), targets)                                # a tokenizing pass that stopped one row short
    with pytest.raises(GuardError, match="built from captions"):
        assert_same_rows(store(10, fp="xyz"), targets)                     # same count, other captions
    with pytest.raises(GuardError, match="row ids 0..8"):
        assert_same_rows(store(10), types.SimpleNamespace(source_fingerprint="abc", n_rows=10, row_ids=np.arange(9), folder="targets"))


def test_a_run_trains_on_exactly_the_rows_run_rows_decides(tmp_path, monkeypatch):
    "The rows a smoke run drew its batches from (its BatchPlan, step by step) are run_rows's set: train_rows honoured, held-out rows never drawn."
    from captionbert.alignment import AlignmentConfig
    from captionbert.consensus import build_consensus
    from captionbert.sources import SceneGrammar
    from captionbert.loop import TrainConfig
    from captionbert.train import run_consensus_training
    from captionbert.recipe import run_rows
    monkeypatch.setenv("CAPTIONBERT_CACHE", str(tmp_path / "cache"))
    cap = tmp_path / "captions.txt"
    cap.write_text("\n".join(SceneGrammar(n=400, seed=4)[i] for i in range(400)) + "\n")
    tg = build_consensus(AlignmentConfig(name="tiny", captions=str(cap), fit_n_over_d=0.5, eval_rows=48, shard_size=128), tmp_path / "targets",
                         device="cpu", progress=False)
    cfg = TrainConfig.smoke(train_rows=300, eval_rows=64, batch_size=16, max_steps=40, eval_every=40, ckpt_every_steps=40)
    job = run_consensus_training(seed=2, preset="smoke", run_dir=tmp_path / "run", targets=str(tg.folder), device="cpu", progress=False,
                                 train_config=cfg)
    assert job.result.completed
    want = run_rows(cfg, 400, seed=2, lengths=job.corpus.lengths)
    drawn = np.concatenate([job.batches.rows_at(s) for s in range(cfg.max_steps)])          # what training actually read
    per_epoch = job.batches.batches_per_epoch
    assert per_epoch == 300 // 16 and cfg.max_steps > per_epoch                               # the steps cover one whole epoch
    one_epoch = np.concatenate([job.batches.rows_at(s) for s in range(per_epoch)])
    assert set(drawn) <= set(want.train.tolist()) and drawn.max() < 300                      # never a row past train_rows
    assert len(set(one_epoch)) == len(one_epoch) == per_epoch * 16                          # an epoch draws each row at most once ...
    assert len(set(want.train.tolist()) - set(one_epoch.tolist())) < 16                     # ... and misses only the short batch dropped
    assert not set(drawn) & set(job.eval_rows.tolist()) and set(job.eval_rows.tolist()) == set(want.eval.tolist())
    assert job.eval_rows.min() >= 300                                                       # 100 rows past the range hold the 64
    assert json.loads((tmp_path / "run" / "config.json").read_text())["corpus"]["train_rows"] == want.n_train == 300


def _embedding_store(folder, n, d, shard, teacher="t"):
    "A merged teacher-embedding store written by hand: `n` rows of width `d` in shards of `shard` rows (vector of row i = i + column/1000)."
    from captionbert.core import sha256_file
    shards = {}
    for k, lo in enumerate(range(0, n, shard)):
        hi = min(lo + shard, n); p = folder / teacher / f"shard-{k:05d}.safetensors"; p.parent.mkdir(parents=True, exist_ok=True)
        vec = torch.arange(lo, hi, dtype=torch.float32)[:, None] + torch.arange(d, dtype=torch.float32) / 1000
        save_file({"embeddings": vec, "row_ids": torch.arange(lo, hi)}, str(p))
        shards[f"{k:05d}"] = {"rows": [lo, hi], "count": hi - lo, "sha256": {teacher: sha256_file(p)}}
    (folder / "manifest.json").write_text(json.dumps({"teachers": [{"name": teacher}], "dims": {teacher: d}, "rows": n,
                                                      "shards": shards, "complete": True}))
    from captionbert.embed import EmbeddingStore
    return EmbeddingStore(folder)


def test_embedding_rows_are_read_from_memory_mapped_shards_not_whole_shards(tmp_path, monkeypatch):
    "EmbeddingStore.load(rows=...) (the alignment fit, the write-back probe, the geometry sample) holds the rows asked, never a whole shard."
    import tracemalloc
    import captionbert.embed as E   # the store's module: EmbeddingStore.load opens shards through its safe_open
    from captionbert.core import GuardError
    n, d, shard = 60_000, 128, 16_384                               # 4 shards; one shard is 8 MB of vectors
    store = _embedding_store(tmp_path / "emb", n, d, shard)
    opened = []
    class _Recording:                                              # safe_open that records every tensor decoded whole
        def __init__(self, path, fw): self.f = E_safe_open(path, fw)
        def __enter__(self): self.f.__enter__(); return self
        def __exit__(self, *a): return self.f.__exit__(*a)
        def get_tensor(self, name): x = self.f.get_tensor(name); opened.append((name, tuple(x.shape))); return x
    E_safe_open = E.safe_open
    monkeypatch.setattr(E, "safe_open", _Recording)
    rows = np.random.default_rng(0).choice(n, 2048, replace=False)  # across every shard, in random order
    tracemalloc.start()
    got = store.load("t", rows=rows)
    _, peak = tracemalloc.get_traced_memory(); tracemalloc.stop()
    assert opened == [], f"load(rows) decoded whole tensors {opened}: it must read only the rows asked from memory-mapped shards"
    want = torch.as_tensor(rows, dtype=torch.float32)[:, None] + torch.arange(d, dtype=torch.float32) / 1000
    assert torch.equal(got, want)                                  # row ids, in the order asked, across shards
    asked = 2048 * d * 4
    assert peak < 3 * asked < shard * d * 4, f"load(rows) allocated {peak / 2**20:.1f} MB for {asked / 2**20:.1f} MB of rows"
    assert torch.equal(store.load("t", rows=[n - 1, 0]), want.new_tensor([[n - 1.0], [0.0]]) + torch.arange(d) / 1000)
    with pytest.raises(IndexError, match=r"rows \[60000\] are not in"):
        store.load("t", rows=[5, n])
    # identity on the rows read: a shard whose row ids no longer match its manifest range is refused, naming the file
    p = tmp_path / "emb" / "t" / "shard-00001.safetensors"
    save_file({"embeddings": torch.zeros(shard, d), "row_ids": torch.arange(shard)}, str(p))
    with pytest.raises(GuardError, match=r"shard-00001.safetensors does not hold rows 16384..32767"):
        store.load("t", rows=[shard + 3])
    with pytest.raises(GuardError, match="does not match its manifest sha256"):
        store.load("t", rows=[shard + 3], verify=True)
    assert store.load("t", rows=[3]).shape == (1, d)               # the other shards still read


def test_geometry_sample_does_not_list_every_row(monkeypatch):
    "geometry_rows (04's geometry and write-back probe) draws its sample from 2.5 billion rows without a permutation or a list of them."
    import tracemalloc
    from captionbert.consensus import geometry_rows
    from captionbert.targets import ConsensusTargets, TargetRows
    tr = object.__new__(TargetRows)                                  # two shards with a gap: rows 0..1e9-1 and 1.5e9..2.5e9-1
    tr.folder, tr.dim, tr._vec = Path("huge"), 8, [None, None]
    tr._lo, tr._hi = np.array([0, 1_500_000_000]), np.array([1_000_000_000, 2_500_000_000])
    def _listed(): raise AssertionError("every row id was listed (8 bytes a row: 16 GB here)")
    monkeypatch.setattr(tr, "row_ids", _listed)
    tg = ConsensusTargets(Path("huge"), tr, {"frame": "f", "shards": {}})
    tracemalloc.start()
    rows = geometry_rows(tg, 8192, seed=3)
    _, peak = tracemalloc.get_traced_memory(); tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MB traced to sample 8,192 rows"
    r = rows.numpy()
    assert len(r) == len(set(r.tolist())) == 8192
    assert not ((r >= 1_000_000_000) & (r < 1_500_000_000)).any() and r.min() >= 0 and r.max() < 2_500_000_000   # rows held, not positions
    assert (r >= 1_500_000_000).any() and (r < 1_000_000_000).any()
    assert torch.equal(geometry_rows(tg, 8192, seed=3), rows) and not torch.equal(geometry_rows(tg, 8192, seed=4), rows)
    assert tr.ids_at([0, 999_999_999, 1_000_000_000, 1_999_999_999]).tolist() == [0, 999_999_999, 1_500_000_000, 2_499_999_999]
    with pytest.raises(IndexError, match="outside the 2000000000 rows"):
        tr.ids_at([2_000_000_000])
