"""The scale rehearsal, small: `python -m captionbert.rehearsal` runs every published stage and prints one JSON object."""
import json
import pytest
from pathlib import Path
import subprocess
import sys

from safetensors import safe_open


pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RssAnon is read from /proc (Linux)")


def test_rehearsal_command_small(tmp_path):
    out = tmp_path / "r"
    r = subprocess.run([sys.executable, "-m", "captionbert.rehearsal", "--rows", "1000", "--out", str(out), "--steps", "12",
                        "--batch-size", "32", "--shard-size", "256"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["rows"] == 1000 and list(res["seconds"]) == ["tokens", "embed", "maps", "targets", "train"]
    assert set(res["embed_rows_per_s"]) == {"rank-0-of-2", "rank-1-of-2"}               # two embedding processes did the work
    emb = json.loads((out / "embeddings" / "manifest.json").read_text())
    assert {k: v["rows_embedded"] for k, v in emb["ranks"].items()} == {"rank-0-of-2": 512, "rank-1-of-2": 488}
    tg = json.loads((out / "targets" / "targets.json").read_text())
    assert tg["dim"] == 768 and sum(s["n"] for s in tg["shards"].values()) == 1000       # targets at the published width, every row
    with safe_open(str(out / "targets" / "targets" / "shard-00003.safetensors"), "pt") as f:
        assert f.get_tensor("row_ids").tolist() == list(range(768, 1000))
    steps = [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines() if '"step"' in l]
    assert res["completed"] and max(s["step"] for s in steps) == 12
    assert res["processes_sampled"] >= 4                        # the launcher, 2 embedding ranks and this process were all sampled
    # a RAM budget that can be missed: the 50k and 200k rehearsals peaked at 1,288 MB; a loader that held every row's
    # tokens, vectors and targets at once, or a leak per stage, shows up above it long before published size
    assert 0 < res["peak_rss_anon_mb"] < 3000, res["peak_rss_anon_mb_by_stage"]
