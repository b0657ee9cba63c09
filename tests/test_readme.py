"""The README's commands and example stay true."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(lang=""):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    command = ci[-1]
    assert "pytest" in command
    assert any(block.strip() == command for block in _code_blocks()), "README and .ci/run disagree"


def test_readme_python_examples_run(tmp_path, monkeypatch):
    from quantgate.quant import SCHEMES

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    schemes = dict(SCHEMES)
    try:
        for example in _code_blocks("python"):  # in order, sharing names, as a reader would run them
            exec(compile(example, "README.md", "exec"), namespace)
    finally:  # the example registers a scheme: leave the registry as the other tests expect it
        SCHEMES.clear()
        SCHEMES.update(schemes)
    assert (tmp_path / "runs" / "observe" / "observe_sink.png").is_file()
    assert namespace["out"].shape == (1, 4, 32, 16) and namespace["mass"].shape == (1, 4, 32)
    assert qg_variant(namespace["q_model"]) == "g1-headwise"  # the quantized copy of the first model
    assert (tmp_path / "runs" / "train" / "training.png").is_file() and (tmp_path / "runs" / "q").is_dir()


def qg_variant(model) -> str:
    return model.config.quantgate["variant"]


def test_main_job_is_the_default_study_and_it_validates():
    """The main job runs the packaged quantgate/studies/quickstart.yaml (its output is committed in
    results/quickstart). Here: the command is that study, and the study file is valid."""
    from quantgate.study import DEFAULT_STUDY, load_study

    main_job = next(b.strip() for b in _code_blocks() if "quantgate " in b and "pytest" not in b)
    assert main_job.split("&&")[-1].split() == ["quantgate", "study"]
    study = load_study(DEFAULT_STUDY)
    assert {m.name for m in study.models} == {"smollm2-135m", "twin-vanilla", "twin-g1"}
    assert len(study.cells()) == 3 and not any(m.train for m in study.models)  # the twins are loaded, not trained


def test_numbers_quoted_from_committed_results_are_in_them():
    """A README paragraph that cites a committed report (results/<study>/report.md, the retrofit readout) quotes
    only numbers that the results pages it cites hold."""
    cited = r"(results/\w+/(?:report|readout)\.md)"
    paragraphs = [p for p in README.split("\n\n") if re.search(cited, p)]
    assert paragraphs
    for paragraph in paragraphs:
        report = "\n".join((ROOT / f).read_text() for f in re.findall(r"results/[\w/.-]+?\.md", paragraph))
        quoted = re.findall(r"\d+\.\d+(?:e[+-]\d+)?", paragraph)
        assert quoted and all(n in report for n in quoted), [n for n in quoted if n not in report]
