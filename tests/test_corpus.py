"""The corpus on the command line (issue 26 §1): `python -m captionbert.consensus inspect` counts a local table of
CaptionEmporium's schema that the test writes and writes the source manifest; `python -m captionbert.train --dry-run`
reads a manifest's count and says what the row check will do, and `--accept-rows` reaches every stage of the plan."""
import json
import os
import subprocess
import sys
from pathlib import Path

from captionbert.alignment import PUBLISHED_CAPTIONS
from captionbert.sources import cc12m_like_rows, write_caption_table

LLAVA = "caption_llava+caption_llava_short+caption"


def _run(args, cache, timeout=180):
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}, "CUDA_VISIBLE_DEVICES": "",
           "HF_HUB_OFFLINE": "1", "CAPTIONBERT_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=timeout, check=True).stdout


def test_inspect_counts_a_local_table_and_writes_its_manifest(tmp_path):
    "Each column's non-empty cells (the empty ones skipped and counted), the flattened rows, the layout, the sha256; the manifest where the row check looks."
    rows = cc12m_like_rows(40, seed=2, empty={"caption_llava_short": [1], "caption": [2, 3, 4]})
    for name in ("cc12m.jsonl.gz", "cc12m.parquet"):
        f = write_caption_table(rows, tmp_path / name)
        spec = f"{'parquet' if name.endswith('parquet') else 'jsonl'}:{f}:{LLAVA}"
        out = _run(["captionbert.consensus", "inspect", "--source", spec, "--chunk-size", "50"], tmp_path / "cache")
        lines = out.splitlines()
        assert lines[0] == f"source     {spec}", out
        assert any(l.split()[:8] == ["caption", "rows", "40", "non-empty", "37", "empty", "3", "ids"] for l in lines), out
        assert "flattened  116 rows" in lines, out                                   # 40 + 39 + 37
        assert [l.split()[:4] for l in lines if l.startswith("  chunk")] == [["chunk", "0", "rows", "0..49"], ["chunk", "1", "rows", "50..99"],
                                                                               ["chunk", "2", "rows", "100..115"]], out
        man = json.loads(Path(lines[-1].split(maxsplit=1)[1]).read_text())
        assert (man["rows"], man["spec"], man["columns"]["caption_llava_short"]["empty"]) == (116, spec, 1)
        assert Path(lines[-1].split(maxsplit=1)[1]).parent == tmp_path / "cache" / "sources"   # where the plan and the row check look


def test_dry_run_reads_the_count_and_accept_rows_reaches_every_stage(tmp_path):
    "A manifest of the published spec counted at 32,895,516 (as `inspect` would write it on the hub): the plan reads the row check's refusal; with --accept-rows it passes."
    from captionbert.corpus import source_manifest_path
    os.environ["CAPTIONBERT_CACHE"] = str(tmp_path / "cache")
    try: path = source_manifest_path(PUBLISHED_CAPTIONS)
    finally: os.environ.pop("CAPTIONBERT_CACHE")
    cols = {c: {"rows": 10_965_172, "non_empty": 10_965_172, "empty": 0} for c in LLAVA.split("+")}
    path.write_text(json.dumps({"spec": PUBLISHED_CAPTIONS, "rows": 32_895_516, "columns": cols, "counted_at": "2026-01-01T00:00:00",
                                "identity": f"columns {LLAVA} of CaptionEmporium/conceptual-captions-cc12m-llavanext at commit {'e' * 12}"}))
    plan = json.loads(_run(["captionbert.train", "--preset", "v2b", "--dry-run"], tmp_path / "cache"))
    c = plan["corpus"]
    assert (c["counted_rows"], c["declared_rows"], plan["corpus_rows"]) == (32_895_516, 31_905_616, 31_905_616)
    assert c["row_check"].startswith(f"refuses: the caption source {PUBLISHED_CAPTIONS!r} holds 32,895,516 rows but is declared to hold 31,905,616")
    assert f"at commit {'e' * 12}" in c["row_check"] and "pass --accept-rows 32895516" in c["row_check"], c["row_check"]
    plan = json.loads(_run(["captionbert.train", "--preset", "v2b", "--dry-run", "--accept-rows", "32895516"], tmp_path / "cache"))
    assert (plan["corpus"]["row_check"], plan["corpus_rows"], plan["train_range"]) == ("passes", 32_895_516, [0, 32_895_516])
    assert plan["stages"][0] == "python -m captionbert.consensus tokens --preset published --accept-rows 32895516"
    assert " --limit 32895516 " in plan["stages"][1] and plan["stages"][2].endswith(" -p accept_rows 32895516"), plan["stages"]
    assert plan["stages"][3].endswith(" --accept-rows 32895516"), plan["stages"][3]
