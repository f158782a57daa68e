"""Shared test setup: plotly renderer, thread budget per xdist worker, the --slow flag, and where the real data is."""
import os

import pytest

os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype")   # else each figure embeds 5 MB of JS
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // _workers)))   # OMP_NUM_THREADS, when set, decides


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run full-size checks (all eight STS tasks, notebook cells tagged #| slow)")


def pytest_configure(config):
    if config.getoption("--slow"): os.environ["CAPTIONBERT_SLOW"] = "1"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CAPTIONBERT_SLOW"): return
    skip = pytest.mark.skip(reason="full-size check: run with --slow or CAPTIONBERT_SLOW=1")
    for item in items:
        if "slow" in item.keywords: item.add_marker(skip)


@pytest.fixture(scope="session")
def sts_dir():
    "The folder of <task>.tsv files (CAPTIONBERT_STS_DIR or the development copy); skips when absent."
    from captionbert.data import STS_DIR_VAR, find_data
    d = find_data(STS_DIR_VAR, "sts")
    if d is None or not d.is_dir():
        pytest.skip(f"the STS test sets are not on this machine: set {STS_DIR_VAR} to a folder of <task>.tsv files")
    return d


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path, monkeypatch):
    """Whatever a test writes through `tempfile` — in this process (notebooks run in-process) or in a kernel or worker it
    starts (TMPDIR) — lands in the test's own folder, removed when the test ends: a smoke study writes hundreds of MB
    and CI's disk is finite."""
    import shutil, tempfile
    d = tmp_path / "tempfile"; d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)
