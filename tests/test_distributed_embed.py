"""Teacher embedding across processes: 2 gloo processes write the same store as 1, a killed embedding resumes, the merge verifies."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _dist import spawn_gloo
from captionbert.core import GuardError
from captionbert.sources import SceneGrammar
from captionbert.teachers import load_teachers, roster
from captionbert.embed import EmbeddingStore, embed_corpus, merge_shards

N, SHARD = 120, 16                     # 8 shards: rank 0 takes 00000, 00002, ..., rank 1 takes 00001, 00003, ...


def _embed(rank, world, folder):
    store = embed_corpus(SceneGrammar(n=N, seed=5), load_teachers(roster("offline"), device="cpu"), folder,
                         shard_size=SHARD, batch_size=8, progress=False, distributed=True)
    assert store.complete and store.n_rows == N      # every rank returns the merged store


def _embed_alone(rank, world, folder):
    "Without `distributed`, a process of a group embeds every shard itself and waits on no other rank (as build_consensus does under DDP)."
    store = embed_corpus(SceneGrammar(n=N, seed=5), load_teachers(roster("offline"), device="cpu"), f"{folder}/rank{rank}",
                         shard_size=SHARD, batch_size=8, progress=False)
    assert store.manifest["ranks"] == {"rank-0-of-1": store.manifest["ranks"]["rank-0-of-1"]} and store.n_rows == N


def test_a_group_member_embeds_alone_unless_asked_to_share(tmp_path):
    spawn_gloo(_embed_alone, 2, str(tmp_path))      # with the old default (share whenever a group exists) each would wait at a barrier for the other's half


def test_two_gloo_processes_write_the_store_one_process_writes(tmp_path):
    spawn_gloo(_embed, 2, str(tmp_path / "two"))
    two = EmbeddingStore(tmp_path / "two")
    ranks = two.manifest["ranks"]
    assert {k: v["rows_embedded"] for k, v in ranks.items()} == {"rank-0-of-2": 64, "rank-1-of-2": 56}, ranks  # each its share
    torch.set_num_threads(1)                         # the numerics of the spawned processes
    one = embed_corpus(SceneGrammar(n=N, seed=5), load_teachers(roster("offline"), device="cpu"), tmp_path / "one",
                       shard_size=SHARD, batch_size=8, progress=False)
    assert two.teachers == one.teachers and two.shard_keys == one.shard_keys
    for t in one.teachers:
        a, b = one.load(t), two.load(t)
        assert a.shape == (N, one.manifest["dims"][t])
        worst = (a - b).abs().max().item()
        assert worst < 1e-6, f"{t}: 2-process vectors differ from 1-process vectors by {worst}"
    assert torch.equal(two.row_ids(), torch.arange(N))
    # shards are row ranges, not ranks: world size 1 resumes what world size 2 left, recomputing only what is missing
    (tmp_path / "two" / "receipts" / "shard-00003.json").unlink()
    again = embed_corpus(SceneGrammar(n=N, seed=5), load_teachers(roster("offline"), device="cpu"), tmp_path / "two",
                         shard_size=SHARD, batch_size=8, progress=False)
    assert again.manifest["ranks"]["rank-0-of-1"]["rows_embedded"] == SHARD


def _cli(folder, rows, shard):
    return [sys.executable, "-m", "captionbert.embed", "embed", "--source", f"synthetic:{rows}", "--out", str(folder),
            "--shard-size", str(shard), "--batch-size", "16", "--device", "cpu", "--no-progress"]


def test_a_killed_embedding_resumes(tmp_path):
    rows, shard, folder = 1600, 40, tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cli(folder, rows, shard), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    receipts = folder / "receipts"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(list(receipts.glob("shard-*.json"))) < 3: time.sleep(0.02)
    assert proc.poll() is None, f"the embedding ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL); proc.wait()
    done = sorted(p.name for p in receipts.glob("shard-*.json"))
    assert 3 <= len(done) < rows // shard, done
    assert not (folder / "manifest.json").exists()
    with pytest.raises(GuardError, match=r"shard \d{5} \(rows \d+\.\.\d+\) is missing"): merge_shards(folder)
    out = subprocess.run(_cli(folder, rows, shard), env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["rows"] == rows and line["shards"] == rows // shard
    assert line["ranks"]["rank-0-of-1"]["rows_embedded"] == rows - shard * len(done)   # only the unfinished shards
    store = EmbeddingStore(folder)
    assert store.complete and torch.equal(store.row_ids(), torch.arange(rows))
    assert not list(folder.rglob("*.tmp")), "a killed write left a temporary file behind"
    g = load_teachers(roster("offline"), device="cpu")[0]
    texts = list(SceneGrammar(n=rows, seed=0))
    for lo in (0, rows - shard):                     # a shard from before the kill and one from after
        fresh = g.encode(texts[lo:lo + shard], batch_size=16)
        for t, v in fresh.items():
            assert (store.load(t, rows=range(lo, lo + shard)) - v).abs().max() < 1e-5, (t, lo)


def test_build_consensus_consumes_the_store_the_embed_command_writes(tmp_path, monkeypatch):
    "04 reads the torchrun stage's merged store: no embedding of its own, the same targets as when it embeds by itself."
    from captionbert import consensus as C
    from captionbert.alignment import AlignmentConfig
    monkeypatch.setenv("CAPTIONBERT_CACHE", str(tmp_path / "cache"))   # build_consensus's own embedding lands here, not in a shared cache
    cap = tmp_path / "captions.txt"
    cap.write_text("\n".join(SceneGrammar(n=300, seed=2)[i] for i in range(300)) + "\n")
    cfg = AlignmentConfig(name="tiny", captions=str(cap), fit_n_over_d=0.5, eval_rows=48, shard_size=64, batch_size=32)
    cmd = [sys.executable, "-m", "captionbert.embed", "embed", "--source", str(cap), "--out", str(tmp_path / "emb"),
           "--roster", "offline", "--shard-size", "64", "--batch-size", "32", "--device", "cpu", "--no-progress"]
    out = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    torch.set_num_threads(1)                                 # the numerics of the command's process
    embedded_here = []
    real = C.embed_cached
    monkeypatch.setattr(C, "embed_cached", lambda *a, **k: embedded_here.append(1) or real(*a, **k))
    consumed = C.build_consensus(cfg, tmp_path / "from-store", device="cpu", progress=False, embeddings=tmp_path / "emb")
    assert embedded_here == [], "build_consensus embedded although it was given a store"
    itself = C.build_consensus(cfg, tmp_path / "itself", device="cpu", progress=False)
    assert embedded_here == [1]
    assert consumed.manifest["embeddings"] == str(tmp_path / "emb") and consumed.n_rows == itself.n_rows == 300
    assert consumed.frame == itself.frame                    # the same maps fit on the same vectors
    worst = (consumed.targets[range(300)] - itself.targets[range(300)]).abs().max().item()
    assert worst <= 1e-6, f"targets from the command's store differ from build_consensus's own by {worst}"
    other = AlignmentConfig(name="tiny", captions=str(cap), limit=200, fit_n_over_d=0.5, eval_rows=48, shard_size=64, batch_size=32)
    with pytest.raises(GuardError, match="embedded from captions"):
        C.build_consensus(other, tmp_path / "cut", device="cpu", progress=False, embeddings=tmp_path / "emb")
