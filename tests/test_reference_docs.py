"""docs/reference/: the committed pages are what scripts/reference_docs.py generates from the registries now, its
--check notices a page that is not, and each registered scheme and each command has its entry."""

from pathlib import Path

import pytest
from conftest import load_script, run_python

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
REGENERATE = "run python scripts/reference_docs.py"


@pytest.fixture(scope="module")
def generator():
    return load_script(ROOT / "scripts" / "reference_docs.py", "reference_docs")


@pytest.fixture(scope="module")
def rendered(generator) -> dict[str, str]:
    return generator.render_all()


@pytest.mark.parametrize("name", ["schemes.md", "variants.md", "study-yaml.md", "cli.md"])
def test_committed_page_is_current(rendered, name):
    path = REFERENCE / name
    assert path.is_file(), f"docs/reference/{name} is missing: {REGENERATE}"
    assert path.read_text(encoding="utf-8") == rendered[name], f"docs/reference/{name} is stale: {REGENERATE}"


def test_every_page_is_tested(generator):
    assert sorted(generator.PAGES) == ["cli.md", "schemes.md", "study-yaml.md", "variants.md"]


def test_pages_say_they_are_generated(rendered):
    for name, text in rendered.items():
        assert text.splitlines()[0] == rendered["cli.md"].splitlines()[0], name
        assert "python scripts/reference_docs.py" in text.splitlines()[0] and "do not edit" in text.splitlines()[0]


def test_check_names_a_page_edited_by_one_character(generator, tmp_path, capsys):
    generator.write(tmp_path)
    assert generator.stale(tmp_path) == []
    assert generator.main(["--check", "--out", str(tmp_path)]) == 0
    page = tmp_path / "variants.md"
    text = page.read_text(encoding="utf-8")
    i = text.index("g1-headwise")
    page.write_text(text[:i] + "G" + text[i + 1 :], encoding="utf-8")
    assert generator.stale(tmp_path) == ["variants.md"]
    capsys.readouterr()
    assert generator.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "variants.md is stale: run python scripts/reference_docs.py" in err
    assert "schemes.md" not in err and "cli.md" not in err


def test_check_names_a_missing_page(generator, tmp_path):
    generator.write(tmp_path)
    (tmp_path / "cli.md").unlink()
    assert generator.stale(tmp_path) == ["cli.md"]


def test_check_notices_a_newly_registered_scheme(generator, tmp_path):
    from quantgate.quant.schemes import SCHEMES, SimulatedScheme, TensorQuant

    generator.write(tmp_path)
    with SCHEMES.snapshot():  # the registry is as the other tests expect it afterwards
        SCHEMES.add(
            "w6-int6-extra",
            SimulatedScheme(
                "w6-int6-extra", "an extra scheme this test registers", weight=TensorQuant("int6", "channel")
            ),
        )
        assert generator.stale(tmp_path) == ["schemes.md"]
        assert "### `w6-int6-extra`" in generator.render_schemes()
    assert generator.stale(tmp_path) == []


def test_check_exits_1_from_the_command_line(generator, tmp_path):
    """The script as CI runs it (its own process, the package found from the checkout)."""
    generator.write(tmp_path)
    page = tmp_path / "schemes.md"
    page.write_text(page.read_text(encoding="utf-8") + " ", encoding="utf-8")
    script = str(ROOT / "scripts" / "reference_docs.py")
    run = run_python([script, "--check", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == [f"{tmp_path / 'schemes.md'} is stale: {REGENERATE}"]


def test_every_scheme_and_gate_has_its_entry():
    from quantgate.quant.schemes import OPTIONS, SCHEMES
    from quantgate.variants import GATE_KINDS, AttentionVariant

    schemes = (REFERENCE / "schemes.md").read_text(encoding="utf-8")
    for name in SCHEMES:
        assert f"### `{name}`" in schemes, f"{name} is not on docs/reference/schemes.md: {REGENERATE}"
    for key in OPTIONS:
        assert f"| `{key}` |" in schemes, f"option {key} is not on docs/reference/schemes.md: {REGENERATE}"
    variants = (REFERENCE / "variants.md").read_text(encoding="utf-8")
    for name in [*GATE_KINDS, *AttentionVariant.describe()]:
        assert f"| `{name}` |" in variants, f"{name} is not on docs/reference/variants.md: {REGENERATE}"


def test_every_command_has_its_section():
    import argparse

    from quantgate.cli import build_parser

    cli = (REFERENCE / "cli.md").read_text(encoding="utf-8")
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sub.choices
    for name, command in sub.choices.items():
        assert f"## quantgate {name}\n" in cli, f"command {name} is not on docs/reference/cli.md: {REGENERATE}"
        section = cli.split(f"## quantgate {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in command._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in section, f"{name} {flag} is not on docs/reference/cli.md: {REGENERATE}"


def test_every_study_key_has_its_row():
    from quantgate.study import schema

    page = (REFERENCE / "study-yaml.md").read_text(encoding="utf-8")
    sections = page.split("\n## ")
    for title, rules in [("Top level", schema.TOP_KEYS), ("models", schema.MODEL_KEYS), *schema.SECTION_RULES.items()]:
        (section,) = [s for s in sections if s.startswith(f"{title}\n")]
        for key in rules:
            assert f"| `{key}` |" in section, f"{title}: {key} is not on docs/reference/study-yaml.md: {REGENERATE}"
    (train,) = [s for s in sections if s.startswith("train\n")]
    assert all(f"| `{key}` |" in train for key in schema.TRAIN_RULES)


def test_stated_study_defaults_are_load_studys(generator, tmp_path):
    """The defaults the page states for top-level and model keys (written in the generator, since they live in
    load_study's code rather than in a table) are the ones load_study applies."""
    from quantgate.study import schema
    from quantgate.study.grid import PresetSource

    assert set(generator.STUDY_DEFAULTS) <= set(schema.TOP_KEYS)
    assert set(generator.MODEL_DEFAULTS) <= set(schema.MODEL_KEYS)
    path = tmp_path / "my-study.yaml"
    path.write_text("models:\n  - preset: tiny-llama\n")
    study = schema.load_study(path)
    (model,) = study.models
    assert study.name == "my-study" and study.description == "" and study.executor == "serial"
    assert getattr(study, "out", None) is None  # quantgate study's default: results/<name>
    assert model.name == "tiny-llama" and model.seeds == [0] and model.variants == ["vanilla"]
    assert model.schemes == [] and model.dtype is None and model.train is None
    assert model.resources is None and model.placement is None
    assert model.source == PresetSource("tiny-llama", {})
    for sec, settings in [("eval", model.eval), ("observe", model.observe), ("calibration", model.calibration)]:
        for key, default in schema.SECTION_KEYS[sec].items():
            assert getattr(settings, key) == default, (sec, key)


def test_output_is_deterministic(generator, rendered, monkeypatch):
    """Neither the terminal's width nor a second rendering changes a page."""
    monkeypatch.setenv("COLUMNS", "37")
    assert generator.render_all() == rendered
    for text in rendered.values():
        assert str(ROOT) not in text and " at 0x" not in text
