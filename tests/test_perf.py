"""The command line of `captionbert.perf` at the tiny preset: the JSON it prints is the dict it returns, its figures are
the per-step record's, and `--profile` reports shares that a step's time can hold."""
import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from captionbert.encoder import EncoderConfig
from captionbert.perf import MATMUL_OPS, main, model_flops_per_step

TINY = ["--preset", "tiny", "--batch-size", "8", "--batches", "2"]


def test_benchmark_command(capsys):
    res = main(TINY + ["--rounds", "2", "--device", "cpu", "--peak-tflops", "1"])
    assert json.loads(capsys.readouterr().out) == res
    steps = res["steps"]
    assert res["steps_timed"] == len(steps) == 4 and [r["round"] for r in steps] == [0, 0, 1, 1]
    assert all(r["captionbert"]["tokens"] == r["bert"]["tokens"] for r in steps), "the two models stepped on different batches"
    assert [r["first"] for r in steps] == ["captionbert", "bert", "bert", "captionbert"], "the order does not alternate"
    t = {k: [r[k]["s"] for r in steps] for k in ("captionbert", "bert")}
    assert res["train_step_ratio_vs_bert"] == pytest.approx(sum(t["bert"]) / sum(t["captionbert"]), abs=1e-4)
    assert res["pair_ratio_median"] == pytest.approx(statistics.median(b / o for b, o in zip(t["bert"], t["captionbert"])), abs=1e-4)
    assert res["captionbert"]["median_step_ms"] == pytest.approx(1000 * statistics.median(t["captionbert"]), abs=0.01)
    assert res["captionbert"]["params"] == res["bert"]["params"]
    assert "Adam" in res["step"] and "clip_grad_norm_" in res["step"], res["step"]
    # MFU: every timed step's FLOPs (from the recorded batch shapes) over their total time, at the given 1 TFLOP/s peak
    shapes = [SimpleNamespace(input_ids=torch.empty(r["rows"], r["length"])) for r in steps]
    assert res["mfu"] == pytest.approx(model_flops_per_step(EncoderConfig.tiny(), shapes) / res["captionbert"]["total_s"] / 1e12, abs=1e-4)


def test_profile_command(capsys):
    res = main(TINY + ["--profile", "--profile-steps", "2"])
    assert json.loads(capsys.readouterr().out) == res
    for k in ("captionbert", "bert"):
        p = res[k]
        assert 0 < p["matmul_share"] <= 1 and p["matmul_ms"] <= p["ops_self_ms"] <= p["wall_ms"], p
        assert set(p["matmul_ops"]) <= set(MATMUL_OPS), p["matmul_ops"]
        assert p["matmul_share"] == pytest.approx(p["matmul_ms"] / p["wall_ms"], abs=1e-3)
    assert res["device"] == "cpu" and res["captionbert"]["params"] == res["bert"]["params"]


def test_all_command_prints_every_ratio_on_one_line(capsys):
    "`--all` at the tiny preset and a few texts (its figures mean nothing): one JSON line, each ratio the record's own times, the same vectors both ways."
    res = main(TINY + ["--rounds", "1", "--all", "--captions", "120", "--sentences", "40", "--profile-steps", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0]) == res
    assert set(res) >= {"train_step", "embedding", "harness", "matmul_peak"}
    for k in ("captionbert", "bert"): assert 0 < res["train_step"]["matmul_share"][k] <= 1
    for k, rows in (("embedding", 120), ("harness", 40)):
        e = res[k]
        assert e["rows"] == rows and e["max_abs_diff"] < 1e-5, e
        assert e["ratio_vs_st"] == pytest.approx(statistics.median(e["st_s"]) / statistics.median(e["ours_s"]), rel=0.01)   # times kept to the ms
