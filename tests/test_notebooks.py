"""Each notebook executed the way `nbdev-test` executes it (execnb, in-process, IN_TEST=1): one test per notebook."""
import os
from pathlib import Path

import pytest
from nbdev.config import get_config
from nbdev.test import test_nb as run_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (ROOT / "nbs").glob("*.ipynb") if not p.name.startswith("_"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(nb):
    cfg = get_config(ROOT)
    skip = cfg.tst_flags.split() if isinstance(cfg.tst_flags, str) else list(cfg.tst_flags)
    force = ["slow"] if os.environ.get("CAPTIONBERT_SLOW") else []
    ok, seconds = run_notebook(nb, skip_flags=skip, force_flags=force, basepath=ROOT, cell_timeout=cfg.cell_timeout)
    assert ok, f"{nb.name} failed (its traceback is printed above)"


def test_every_notebook_is_collected():
    "The numbered notebooks of DESIGN.md's foundation are all here and none is skipped by a .notest file."
    names = {p.stem for p in NOTEBOOKS}
    assert {"00_core", "00a_gauges", "01_data", "01a_teachers", "02_benchmark"} <= names
    assert not (ROOT / "nbs" / ".notest").exists()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_papermill_parameters_cell(nb):
    "A notebook with a Run section has exactly one cell tagged `parameters`, so `papermill -p seed 1` is not ignored."
    import json
    cells = json.loads(nb.read_text())["cells"]
    has_run = any(c["cell_type"] == "markdown" and "".join(c["source"]).lstrip().startswith("## Run:") for c in cells)
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if has_run:
        assert len(tagged) == 1, f"{nb.name} has a Run section but {len(tagged)} cells tagged 'parameters'"
    assert all(c["cell_type"] == "code" for c in tagged)
