"""The routing inspector (nbs/06a_inspector.ipynb) in a real browser: JupyterLab on a loopback port, a notebook with the
inspector on a tiny routed model opened in headless Chromium (Debian's `chromium`, driven by Playwright through its
executable path: no browser download), its cells run, and the page checked: one heatmap row per token, typing a sentence
redraws the rows, unchecking an arm empties its column. A screenshot goes into the test's tmp_path."""
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_VAR = "CAPTIONBERT_CHROMIUM"   # a Chromium (or Chrome) executable; default: `chromium` on the PATH
ARMS = ["equivalence", "simplification", "paraphrase"]
FIRST, SECOND = "a red cube beside a blue ball", "two small dogs play in the deep white snow near a wooden fence"
SETUP = f"""import torch
from captionbert.adapters import AmoeModel, Arm, ArmLibrary
from captionbert.data import load_tokenizer
from captionbert.encoder import CaptionEncoder, EncoderConfig
from captionbert.inspector import RoutingInspector
torch.manual_seed(0)
model = AmoeModel(CaptionEncoder(EncoderConfig.tiny()).eval(),
                  ArmLibrary([Arm(n, 64, 2, 8, random_init=True, seed=i) for i, n in enumerate({ARMS!r})]))
insp = RoutingInspector(model, load_tokenizer(), sentence={FIRST!r})"""
# the heatmap as the page holds it: plotly's graph div carries its traces; the y tick labels are what is drawn
HEATMAP_JS = """() => {
  const h = [...document.querySelectorAll('.js-plotly-plot')].find(g => g.data && g.data[0] && g.data[0].type === 'heatmap');
  if (!h) return null;
  const z = Array.from(h.data[0].z || [], r => Array.from(r));
  return {x: Array.from(h.data[0].x), y: Array.from(h.data[0].y), z: z,
          ticks: [...h.querySelectorAll('.yaxislayer-above .ytick text, .ytick text')].map(t => t.textContent)};
}"""


def _chromium():
    exe = os.environ.get(CHROMIUM_VAR) or shutil.which("chromium") or shutil.which("chromium-browser")
    return exe if exe and Path(exe).exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(sentence: str) -> list:
    "The heatmap's row labels for a sentence, as the inspector writes them: index:token."
    from captionbert.data import load_tokenizer
    tok = load_tokenizer()
    return [f"{i}:{t}" for i, t in enumerate(tok.convert_ids_to_tokens(tok([sentence], truncation=True, max_length=256)["input_ids"][0]))]


def _notebook(path: Path):
    cell = lambda src: {"cell_type": "code", "execution_count": None, "id": secrets.token_hex(4), "metadata": {}, "outputs": [], "source": src}
    nb = {"cells": [cell(SETUP), cell("insp")], "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}}
    path.write_text(json.dumps(nb, indent=1))


def _start_lab(tmp_path: Path):
    "JupyterLab on a free loopback port, its state in tmp_path, the app exposed to the page (window.jupyterapp); returns (proc, url base, token)."
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data"), "IPYTHONDIR": str(tmp_path / "ipython"),   # no history or signatures in ~
           "PLOTLY_RENDERER": ""}
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                             "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path / 'work'}",
                             "--LabApp.expose_app_in_browser=True", "--ServerApp.allow_root=True", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            cwd=tmp_path / "work", env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                if r.status == 200: return proc, base, token
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate(); log.close()
            raise RuntimeError(f"JupyterLab did not answer on {base}: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
        time.sleep(0.5)


def test_inspector_in_a_real_browser(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]' (it drives the browser)")
    exe = _chromium()
    if exe is None:
        pytest.skip(f"no Chromium: install Debian's chromium (apt-get install chromium) or set {CHROMIUM_VAR} to a Chromium executable")
    t0 = time.monotonic()
    (tmp_path / "work").mkdir()
    _notebook(tmp_path / "work" / "inspector.ipynb")
    first, second = _rows(FIRST), _rows(SECOND)
    proc, base, token = _start_lab(tmp_path)
    short_tmp = tempfile.mkdtemp(prefix="cb-", dir="/tmp" if os.path.isdir("/tmp") else None)   # Chromium's singleton socket path must be short
    try:
        with sync_api.sync_playwright() as p:
            home = tmp_path / "home"                                  # Chromium's profile, crash reports and caches stay in tmp_path
            browser = p.chromium.launch(executable_path=exe, headless=True,
                                        args=["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [],
                                        env={**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                                             "XDG_CACHE_HOME": str(home / ".cache"), "TMPDIR": short_tmp})
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.set_default_timeout(240_000)
            page.goto(f"{base}/lab/tree/inspector.ipynb?token={token}")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget && "
                                   "window.jupyterapp.shell.currentWidget.sessionContext && "
                                   "window.jupyterapp.shell.currentWidget.sessionContext.session && "
                                   "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel")
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            try: page.wait_for_function(f"() => {{ const h = ({HEATMAP_JS})(); return h && h.y.length === {len(first)}; }}")
            except sync_api.TimeoutError:
                page.screenshot(path=str(tmp_path / "timeout.png"), full_page=True)
                raise AssertionError(f"no heatmap with {len(first)} rows in the page; it holds {page.evaluate(HEATMAP_JS)} (screenshot {tmp_path / 'timeout.png'})")
            h = page.evaluate(HEATMAP_JS)
            assert h["x"] == ARMS, h["x"]
            assert h["y"] == first, f"the heatmap's rows are not the sentence's tokens: {h['y']} != {first}"
            assert len(h["z"]) == len(first) and all(len(r) == len(ARMS) for r in h["z"]), "one row per token, one column per arm"
            assert sorted(h["ticks"]) == sorted(first), f"the drawn row labels are not one per token: {h['ticks']}"
            assert all(any(abs(v) > 0 for v in col) for col in zip(*h["z"])), "every arm routes some weight while all are on"
            assert page.locator(".widget-html").filter(has_text="negative-weight fraction").count() == 1   # the negative-weight line is shown

            page.locator(".widget-text input").first.fill(SECOND)      # typing a sentence: the widget syncs and the view redraws
            page.wait_for_function(f"() => {{ const h = ({HEATMAP_JS})(); return h && JSON.stringify(h.y) === {json.dumps(json.dumps(second, separators=(',', ':')))}; }}")
            h2 = page.evaluate(HEATMAP_JS)
            assert len(h2["z"]) == len(second) != len(first) and sorted(h2["ticks"]) == sorted(second), h2["ticks"]

            k = ARMS.index("simplification")
            page.locator(".widget-checkbox").filter(has_text="simplification").locator("input").uncheck()
            page.wait_for_function(f"() => {{ const h = ({HEATMAP_JS})(); return h && h.z.every(r => r[{k}] === 0); }}")
            h3 = page.evaluate(HEATMAP_JS)
            assert all(r[k] == 0 for r in h3["z"]), "the unchecked arm's column is not empty"
            assert all(any(abs(r[j]) > 0 for r in h3["z"]) for j in range(len(ARMS)) if j != k), "the other arms' columns emptied too"
            assert h3["y"] == second
            shot = tmp_path / "inspector.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        assert shot.stat().st_size > 10_000, "the screenshot is (nearly) empty"
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)
        proc.terminate()
        try: proc.wait(timeout=30)
        except subprocess.TimeoutExpired: proc.kill()
    # the screenshot and the wall time outlive the test's tmp_path (removed on a pass): runs/browser/, or $CAPTIONBERT_ARTIFACTS
    keep = Path(os.environ.get("CAPTIONBERT_ARTIFACTS") or ROOT / "runs" / "browser"); keep.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, keep / "inspector.png")
    wall = round(time.monotonic() - t0, 1)
    (keep / "browser.json").write_text(json.dumps({"wall_s": wall, "rows": [len(first), len(second)], "unchecked": "simplification",
                                                   "screenshot": str(keep / "inspector.png")}, indent=1))
    print(f"browser test: {wall}s wall (JupyterLab, Chromium, the kernel's cells, three checks); screenshot {keep / 'inspector.png'}")
