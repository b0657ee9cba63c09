"""Issue 41, item 1: output folders by ownership. quantgate writes only into a folder that is missing or empty,
or that it wrote before as the same kind of output (a study run, a training run, an eval, ...); it replaces a
model folder of its own only with --overwrite; it never writes through a link that leads out of its folder.
Every refusal is one line naming the folder, why, and the fix, and comes before the work."""

import json
import shutil

import pytest
from conftest import TINY_STUDY, one_line_error, snapshot_files

import quantgate as qg
from quantgate.cli import main

TRAIN = ["train", "--preset", "tiny-llama", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]


def _must_not_run(monkeypatch, target: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{target} ran before the output folder was checked")

    monkeypatch.setattr(target, refuse)


# --- the hostile cases ----------------------------------------------------------------------------------


def test_quantize_out_into_another_models_folder_refused(float_model, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim"
    qg.save(qg.build("tiny-llama", "g1-headwise", seed=3), victim)
    (victim / "README.md").write_text("the model card")
    before = snapshot_files(victim)
    _must_not_run(monkeypatch, "quantgate.cli._load_or_build")
    argv = ["quantize", str(float_model), "--scheme", "w8a8-int8-dynamic", "--out", str(victim)]
    assert main(argv) == 2
    err = one_line_error(capsys, "quantize")
    assert str(victim) in err and "--overwrite" in err and "empty folder" in err
    assert snapshot_files(victim) == before


def test_quantize_out_into_another_tools_model_folder_refused_even_with_overwrite(
    float_model, tmp_path, monkeypatch, capsys
):
    """A folder quantgate did not write (a model another tool saved) is never replaced, --overwrite or not."""
    victim = tmp_path / "hf-model"
    victim.mkdir()
    (victim / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (victim / "model.safetensors").write_bytes(b"another tool's weights")
    before = snapshot_files(victim)
    _must_not_run(monkeypatch, "quantgate.cli._load_or_build")
    for extra in ([], ["--overwrite"]):
        argv = ["quantize", str(float_model), "--scheme", "w8a8-int8-dynamic", "--out", str(victim), *extra]
        assert main(argv) == 2
        err = one_line_error(capsys, "quantize")
        assert str(victim) in err and "quantgate did not write" in err and "empty folder" in err
    assert snapshot_files(victim) == before


def test_quantize_out_into_an_earlier_export_refused_then_replaced_with_overwrite(float_model, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["quantize", str(float_model), "--scheme", "w8-int8", "--out", str(out)]
    assert main(argv) == 0
    before = snapshot_files(out)
    capsys.readouterr()
    again = ["quantize", str(float_model), "--scheme", "w8a8-int8-dynamic", "--out", str(out)]
    assert main(again) == 2
    err = one_line_error(capsys, "quantize")
    assert str(out) in err and "--overwrite" in err
    assert snapshot_files(out) == before
    assert main([*again, "--overwrite"]) == 0
    record = qg.quantization_of(qg.load(out))
    assert record is not None and record.scheme == "w8a8-int8-dynamic"
    assert main([*again, "--overwrite"]) == 0  # and again: its own folder, replaced whole


def test_study_out_with_foreign_files_refused(tmp_path, monkeypatch, capsys):
    study = tmp_path / "base.yaml"
    study.write_text(TINY_STUDY.format(name="base"))
    d = tmp_path / "d"
    d.mkdir()
    for name in ("config.yaml", "report.md", "metrics.json"):
        (d / name).write_text("mine\n")
    _must_not_run(monkeypatch, "quantgate.study.steps._run_cell")
    assert main(["study", str(study), "--out", str(d)]) == 2
    err = one_line_error(capsys, "study")
    assert str(d) in err and "quantgate did not write" in err and "empty folder" in err
    assert snapshot_files(d) == dict.fromkeys(("config.yaml", "metrics.json", "report.md"), b"mine\n")


def test_study_out_dot_refused(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    (project / "README.md").write_text("mine\n")
    (project / "base.yaml").write_text(TINY_STUDY.format(name="base"))
    before = snapshot_files(project)
    monkeypatch.chdir(project)
    _must_not_run(monkeypatch, "quantgate.study.steps._run_cell")
    assert main(["study", "base.yaml", "--out", "."]) == 2
    err = one_line_error(capsys, "study")
    assert "--out ." in err and "empty folder" in err
    assert snapshot_files(project) == before
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "base.yaml", "pyproject.toml", "src"]


def test_study_symlinked_cells_refused(tmp_path, monkeypatch, capsys):
    study = tmp_path / "base.yaml"
    study.write_text(TINY_STUDY.format(name="base"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = tmp_path / "r"
    r.mkdir()
    (r / "cells").symlink_to(elsewhere)
    _must_not_run(monkeypatch, "quantgate.study.steps._run_cell")
    assert main(["study", str(study), "--out", str(r)]) == 2
    err = one_line_error(capsys, "study")
    assert f"{r / 'cells'} is a symlink leading to {elsewhere}" in err
    assert not any(elsewhere.iterdir())
    assert sorted(p.name for p in r.iterdir()) == ["cells"]


def test_a_symlink_planted_in_a_study_run_is_refused(study_run, tmp_path, monkeypatch, capsys):
    study, finished = study_run
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("mine")
    cell = next(p.parent for p in (run / "cells").rglob("observe") if p.is_dir())
    (cell / "observe").rename(tmp_path / "observe-moved")
    (cell / "observe").symlink_to(elsewhere)
    _must_not_run(monkeypatch, "quantgate.study.steps._run_cell")
    assert main(["study", str(study), "--out", str(run)]) == 2
    assert f"{cell / 'observe'} is a symlink leading to {elsewhere}" in one_line_error(capsys, "study")
    assert snapshot_files(elsewhere) == {"precious.txt": b"mine"}


# --- the other commands, by the same rule ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, work",
    [
        (["eval", "tiny-llama", "--limit", "1", "--out", "OUT"], "quantgate.cli.load_for_eval"),
        (["observe", "tiny-llama", "--out", "OUT"], "quantgate.cli._load_or_build"),
        (["compare", "RUNS", "--out", "OUT"], "quantgate.study.compare.collect_evals"),
        ([*TRAIN, "--out", "OUT"], "quantgate.cli.build"),
        ([*TRAIN, "--out", "OUT", "--overwrite"], "quantgate.cli.build"),
    ],
    ids=["eval", "observe", "compare", "train", "train-overwrite"],
)
def test_every_command_refuses_a_folder_of_foreign_files(argv, work, tmp_path, monkeypatch, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("mine\n")
    (out / "eval.json").write_text('{"mine": true}\n')
    (tmp_path / "runs").mkdir()
    _must_not_run(monkeypatch, work)
    subs = {"OUT": str(out), "RUNS": str(tmp_path / "runs")}
    assert main([subs.get(a, a) for a in argv]) == 2
    err = one_line_error(capsys, argv[0])
    assert str(out) in err and "empty folder" in err
    assert snapshot_files(out) == {"eval.json": b'{"mine": true}\n', "notes.md": b"mine\n"}


def test_a_study_run_is_not_written_over_by_another_command(study_run, tmp_path, monkeypatch, capsys):
    _, finished = study_run
    before = snapshot_files(finished)
    _must_not_run(monkeypatch, "quantgate.cli.load_for_eval")
    _must_not_run(monkeypatch, "quantgate.cli.build")
    assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(finished)]) == 2
    assert str(finished) in one_line_error(capsys, "eval")
    assert main([*TRAIN, "--out", str(finished), "--overwrite"]) == 2
    assert str(finished) in one_line_error(capsys, "train")
    assert snapshot_files(finished) == before


def test_train_into_a_model_folder_refused(float_model, tmp_path, monkeypatch, capsys):
    model = tmp_path / "m"
    shutil.copytree(float_model, model)
    before = snapshot_files(model)
    _must_not_run(monkeypatch, "quantgate.cli.build")
    assert main([*TRAIN, "--out", str(model), "--overwrite"]) == 2
    assert str(model) in one_line_error(capsys, "train")
    assert snapshot_files(model) == before


# --- what still works -------------------------------------------------------------------------------------


def test_rerunning_a_study_into_its_own_run_dir_reuses_it(study_run, tmp_path, capsys):
    study, finished = study_run
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    steps = {p: p.stat().st_mtime_ns for p in (run / "cells").rglob("*.json")}
    assert main(["study", str(study), "--out", str(run)]) == 0
    assert {p: p.stat().st_mtime_ns for p in steps} == steps  # every step reused, none recomputed


def test_a_study_run_of_an_older_quantgate_without_the_marker_is_reused(study_run, tmp_path):
    study, finished = study_run
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for marker in run.rglob(".quantgate"):
        marker.unlink()
    assert main(["study", str(study), "--out", str(run)]) == 0
    interrupted = tmp_path / "interrupted"  # stopped before metrics.json: config.yaml and cells/
    shutil.copytree(run, interrupted)
    for name in ("metrics.json", "report.md", ".quantgate"):
        (interrupted / name).unlink()
    assert main(["study", str(study), "--out", str(interrupted)]) == 0


def test_train_overwrite_replaces_its_own_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TRAIN, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*TRAIN, "--out", str(out)]) == 2
    assert "--overwrite" in one_line_error(capsys, "train")
    assert main([*TRAIN, "--out", str(out), "--overwrite"]) == 0
    assert (out / "model" / "config.json").is_file()


def test_eval_observe_and_compare_rerun_into_their_own_folders(tmp_path, capsys):
    ev, obs, cmp = tmp_path / "ev", tmp_path / "obs", tmp_path / "cmp"
    for _ in range(2):
        assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(ev)]) == 0
        assert main(["observe", "tiny-llama", "--max-batches", "1", "--seq-len", "32", "--out", str(obs)]) == 0
        assert main(["compare", str(ev), "--out", str(cmp)]) == 0
    assert (ev / "eval.json").is_file() and (obs / "observe.json").is_file() and (cmp / "compare.md").is_file()


def test_the_marker_names_what_wrote_the_folder(float_model, tmp_path):
    from quantgate.files import MARKER

    assert json.loads((float_model / MARKER).read_text())["kind"] == "model"
    out = tmp_path / "ev"
    assert main(["eval", "tiny-llama", "--limit", "1", "--out", str(out)]) == 0
    assert json.loads((out / MARKER).read_text()) == {"written_by": "quantgate eval", "kind": "eval"}


def test_claim_output_in_python(tmp_path):
    """The rule's one place, as the Python API sees it."""
    from quantgate.files import claim_output

    fresh = tmp_path / "fresh"
    assert claim_output(fresh, "eval") == fresh and not fresh.exists()  # checked, nothing made
    claim_output(fresh, "eval", mark=True)
    claim_output(fresh, "study")  # the marker alone: still empty
    (fresh / "eval.json").write_text("{}")
    claim_output(fresh, "eval")  # its own
    with pytest.raises(
        ValueError, match=r"holds a quantgate evaluation \(written by quantgate eval\), not a study run"
    ):
        claim_output(fresh, "study")
    legacy = tmp_path / "legacy-model"  # saved by an older quantgate: config.json carries its record
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"model_type": "llama", "quantgate": {"variant": "vanilla"}}))
    with pytest.raises(ValueError, match="quantgate did not write"):  # a config.json alone is no model (issue 57)
        claim_output(legacy, "model", overwrite=True)
    (legacy / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match="overwrite"):
        claim_output(legacy, "model")
    claim_output(legacy, "model", overwrite=True)
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "sub").mkdir()
    (inside / "link").symlink_to(inside / "sub")  # a link that stays inside is no escape
    (inside / ".quantgate.lock").write_text("")
    with pytest.raises(ValueError, match="quantgate did not write"):
        claim_output(inside, "study")


def test_a_study_file_inside_its_run_dir_is_not_foreign(tmp_path, monkeypatch, capsys):
    """`mkdir run; write run/study.yaml; quantgate study run/study.yaml --out run` (experiments/twins_search.py
    does so): the study's own file is its input, not another tool's; unless the run would write over it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "study.yaml").write_text(TINY_STUDY.format(name="base"))
    _must_not_run(monkeypatch, "quantgate.study.steps._run_cell")
    with pytest.raises(AssertionError, match="_run_cell ran"):  # the check passed: the cells were reached
        main(["study", str(run / "study.yaml"), "--out", str(run)])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text(TINY_STUDY.format(name="base"))  # the run writes config.yaml: lost
    assert main(["study", str(other / "config.yaml"), "--out", str(other)]) == 2
    assert "quantgate did not write (config.yaml)" in one_line_error(capsys, "study")
