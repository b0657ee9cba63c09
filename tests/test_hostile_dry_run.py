"""Issue 57 (item 5, and two of item 7's messages): the dry run refuses what a run would.

``quantgate study FILE --dry-run`` (and a real run, before it writes anything) refuses, in one line naming the
value and the fix, every value the run would fail on later: a seed outside the range every generator it seeds
takes, a name or path the operating system cannot hold (too long, a NUL character), a model whose memory is more
than this machine has free (the audit's check, shared), calibration or observe batches beyond what the data
hold. ``quantgate audit`` refuses a budget that is not a finite duration, prints a tiny tolerance with the digits
that make it non-zero, and names the unit of a synthetic task's sets (sequences in batches of 16), not documents.
"""

import re
import time
from pathlib import Path

import pytest
from conftest import TINY_STUDY, one_line_error

from quantgate.cli import main
from quantgate.study import StudyError, load_study

MAX_SEED = 2**32 - 1  # numpy's legacy seed (accelerate's set_seed) is the narrowest generator a run seeds


def _study(tmp_path: Path, text: str, name: str = "study.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def _refused(capsys, tmp_path: Path, text: str, *wants: str, seconds: float = 20) -> str:
    """The study file ``text`` refused by ``--dry-run`` and by a real run (before its output folder exists), in
    one line naming each of ``wants``, within ``seconds``."""
    f = _study(tmp_path, text)
    out = tmp_path / "run"
    start = time.perf_counter()
    assert main(["study", str(f), "--dry-run"]) == 2
    line = one_line_error(capsys, "study")
    assert time.perf_counter() - start < seconds
    for want in wants:
        assert want in line, line
    assert main(["study", str(f), "--out", str(out)]) == 2
    assert one_line_error(capsys, "study") == line
    assert not out.exists()
    return line


def _tiny(**replace: str) -> str:
    text = TINY_STUDY.format(name="x")
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


# --- seeds -------------------------------------------------------------------------------------------------


def test_seed_18446744073709551616_refused_at_dry_run(tmp_path, capsys):
    line = _refused(
        capsys, tmp_path, _tiny() + "seed: 18446744073709551616\n", "seed", f"{MAX_SEED}", "18446744073709551616"
    )
    assert ":9:" in line  # the YAML line


SEEDS = {
    "study-seed": ("", "seed: {}\n"),
    "model-seeds": ("    seeds: [0, {}]\n", ""),
    "train-seed": ("    train: {{steps: 2, seed: {}}}\n", ""),
}


@pytest.mark.parametrize("case", SEEDS)
def test_every_seed_of_a_study_file_shares_one_range(case, tmp_path, capsys):
    model, top = SEEDS[case]

    def text(seed: int) -> str:
        return _tiny(**{"preset: tiny-llama\n": "preset: tiny-llama\n" + model.format(seed)}) + top.format(seed)

    _refused(capsys, tmp_path, text(MAX_SEED + 1), f"{MAX_SEED + 1}", f"{MAX_SEED}")
    assert load_study(_study(tmp_path, text(MAX_SEED), "ok.yaml")).models  # the largest seed is one a run takes


def test_train_seed_option_shares_the_range(tmp_path, capsys):
    argv = ["train", "--preset", "tiny-llama", "--seed", "18446744073709551616", "--out", str(tmp_path / "t")]
    assert main(argv) == 2
    assert f"--seed must be in [0, {MAX_SEED}]" in one_line_error(capsys, "train")
    assert not (tmp_path / "t").exists()


def test_the_largest_seed_makes_batches():
    """A seed at the top of the range reaches every generator a run derives from it (MLM masks, shuffles)."""
    import quantgate as qg
    from quantgate.data import batches

    for preset, objective in (("tiny-bert", "mlm"), ("tiny-llama", "clm")):
        tok = qg.tokenizer(preset)
        data = batches(tok, "validation", 32, 2, objective, seed=MAX_SEED, shuffle=True, max_batches=1)
        assert next(iter(data))["input_ids"].shape == (2, 32)


# --- names and paths ---------------------------------------------------------------------------------------


def test_name_of_300_characters_refused_at_dry_run(tmp_path, capsys):
    line = _refused(capsys, tmp_path, TINY_STUDY.format(name="n" * 300), "name", "255 bytes")
    assert ":1:" in line


def test_model_name_of_300_characters_refused_at_dry_run(tmp_path, capsys):
    _refused(capsys, tmp_path, _tiny(**{"name: m\n": f"name: {'m' * 300}\n"}), "255 bytes")


def test_out_with_a_component_of_300_characters_refused_at_dry_run(tmp_path, capsys):
    _refused(capsys, tmp_path, _tiny() + f"out: runs/{'o' * 300}\n", "out", "255 bytes")


def test_out_longer_than_the_os_takes_refused_at_dry_run(tmp_path, capsys):
    _refused(capsys, tmp_path, _tiny() + f"out: {'abc/' * 1100}run\n", "out", "4096 bytes")


def test_out_with_null_byte_refused_at_dry_run(tmp_path, capsys):
    line = _refused(capsys, tmp_path, _tiny() + 'out: "a\\0b"\n', "out", "NUL")
    assert ":9:" in line


def test_null_byte_in_a_data_path_refused_at_dry_run(tmp_path, capsys):
    """A local dataset's path (hf:PATH:split) with a NUL: any path a study file names, not only out:."""
    _refused(
        capsys,
        tmp_path,
        _tiny(**{"calibration: {batches: 1,": 'calibration: {data: "hf:./d\\0ir:train", batches: 1,'}),
        "NUL",
    )


# --- memory --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["hidden_size: 1000000", "num_hidden_layers: 100000000"])
def test_model_too_large_for_memory_refused_at_dry_run(override, tmp_path, capsys):
    text = _tiny(**{"preset: tiny-llama\n": f"preset: tiny-llama\n    config: {{{override}}}\n"})
    line = _refused(capsys, tmp_path, text, "m has", "parameters", "GiB", "free here", seconds=30)
    assert ":5:" in line  # the model's config:


def test_audit_and_study_share_one_memory_check(tmp_path, monkeypatch):
    from quantgate.audit.target import AuditError, check_memory, target
    from quantgate.models import cost

    monkeypatch.setattr(cost, "free_memory", lambda: 1000)
    with pytest.raises(StudyError, match=r"tiny has .* parameters.* GiB are free here"):
        load_study(_study(tmp_path, "name: x\nmodels:\n  - name: tiny\n    preset: tiny-llama\n"))
    with pytest.raises(AuditError, match=r"twin-vanilla has .* parameters.* GiB are free here; load it sharded"):
        check_memory(target("twin-vanilla", None), "float32", None)


# --- data sizes -----------------------------------------------------------------------------------------------


def test_calibration_of_a_billion_batches_refused_at_dry_run(tmp_path, capsys):
    line = _refused(
        capsys, tmp_path, _tiny(**{"calibration: {batches: 1,": "calibration: {batches: 1000000000,"}),
        "calibration", "batches", "1000000000", "the train split holds",
    )  # fmt: skip
    held = int(line.split("holds ")[1].split()[0].replace(",", ""))
    assert 40_000 < held < 60_000, line  # about 48K batches of 2 x 32 tokens in the bundled train split
    ok = _tiny(**{"calibration: {batches: 1,": f"calibration: {{batches: {held},"})
    assert load_study(_study(tmp_path, ok, "ok.yaml")).models[0].calibration.batches == held


def test_observe_beyond_the_data_refused_at_dry_run(tmp_path, capsys):
    _refused(
        capsys, tmp_path, _tiny(**{"observe: {batches: 1,": "observe: {batches: 1000000000,"}),
        "observe", "1000000000", "the validation split holds",
    )  # fmt: skip


def test_backcopy_calibration_beyond_its_epoch_refused_at_dry_run(tmp_path, capsys):
    text = _tiny(**{"calibration: {batches: 1,": "calibration: {data: backcopy, batches: 5000,"})
    _refused(capsys, tmp_path, text, "calibration", "5000", "1,000")


# --- the audit's options and page ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget", ["9" * 400, "1" * 400 + "h", "100000h"], ids=["400-digits", "400-digit-hours", "100000h"]
)
def test_budget_of_400_digits_refused_in_one_line(budget, tmp_path, capsys):
    assert main(["audit", "twin-vanilla", "--budget", budget, "--out", str(tmp_path / "a")]) == 2
    line = one_line_error(capsys, "audit")
    assert "--budget" in line and "at most" in line, line
    assert not (tmp_path / "a").exists()


def test_budget_not_finite_refused_by_the_api(tmp_path):
    from quantgate.audit.plan import parse_budget
    from quantgate.errors import InputError

    for budget in (float("inf"), float("nan"), 1e300):
        with pytest.raises(InputError, match="--budget"):
            parse_budget(budget)


@pytest.fixture(scope="module")
def twin_audit(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("twin") / "a"
    args = ["audit", "twin-vanilla", "--out", str(out), "--docs", "1", "--schemes", "w8a8-int8-static"]
    assert main([*args, "--within", "1e-9"]) == 0
    return (out / "audit.md").read_text()


def test_within_1e_9_prints_a_nonzero_tolerance(twin_audit):
    assert "the tolerance is +1e-07%" in twin_audit
    assert "+0.00% on the search" not in twin_audit and "tolerance is +0.00%" not in twin_audit


def test_twin_audit_names_batches_of_sequences_not_documents(twin_audit):
    assert "documents" not in twin_audit, twin_audit
    assert "on the search sequences" in twin_audit
    assert re.search(r"\b1 batch of 16\b|batches of 16", twin_audit), twin_audit
    assert "clustered by work" not in twin_audit
