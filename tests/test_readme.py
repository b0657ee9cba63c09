"""The README and the pages it leads to stay true and short: its set-up commands are CI's, it fits in 200 lines,
no sentence runs past 60 words, its links resolve, and no sentence claims more than its interval. (The pages' code
blocks run in tests/test_doc_blocks.py; the numbers they quote from the committed results are checked by
scripts/headlines.py --check, tests/test_headlines.py.)"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = ["README.md", "docs/getting-started.md", "docs/concepts.md", "docs/findings.md"]
MAX_LINES, MAX_WORDS = 200, 60


def _code_blocks(text: str = README) -> list[str]:
    """The bodies of the fenced blocks of ``text``, whatever their language."""
    return re.findall(r"^```[\w-]*\n(.*?)^```", text, flags=re.S | re.M)


def _sentences(text: str) -> list[str]:
    """The prose of a markdown page as sentences: code blocks, HTML comments and table rows left out; a heading
    or a list item ends the sentence before it."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    units: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        chunk: list[str] = []
        for line in paragraph.splitlines():
            if line.lstrip().startswith("|"):
                continue
            if re.match(r"\s*(#+ |[-*] |\d+\. )", line) and chunk:
                units.append(" ".join(chunk))
                chunk = []
            chunk.append(line.strip())
        if chunk:
            units.append(" ".join(chunk))
    sentences = []
    for unit in units:  # a sentence ends at . ! or ? before a space and anything but a lower-case letter
        sentences += [s for s in re.split(r"(?<=[.!?])\s+(?=[^a-z\s])", unit) if s.strip()]
    return sentences


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    command = ci[-1]
    assert "pytest" in command
    assert any(block.strip() == command for block in _code_blocks()), "README and .ci/run disagree"


def test_the_set_up_commands_are_not_run_by_the_doc_tests():
    """Both install packages: the doc-block runner skips them by the directive on the line before each."""
    for block in _code_blocks():
        if block.startswith("pip install"):
            assert f"<!-- doc-test: skip: installs packages -->\n```bash\n{block}```" in README


def test_readme_is_short():
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines <= MAX_LINES, f"README.md has {lines} lines; at most {MAX_LINES}: move the detail into docs/"


@pytest.mark.parametrize("page", PAGES)
def test_no_sentence_is_longer_than_60_words(page):
    long = [s for s in _sentences((ROOT / page).read_text()) if len(s.split()) > MAX_WORDS]
    assert not long, f"{page}: {len(long[0].split())} words in: {long[0]!r}"


def test_the_sentence_splitter():
    text = "# Title\n\nOne two. Three, e.g. four.\n- item one\n- item two\n\n| a | b |\n|---|---|\n\n"
    text += "```bash\nx. Y\n```\n<!-- doc-test: skip: a reason. Not prose -->\n"
    assert _sentences(text) == ["# Title", "One two.", "Three, e.g. four.", "- item one", "- item two"]


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    """Every relative link of the page names a file or folder that exists, and a heading of it where it
    names an anchor."""
    path = ROOT / page
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text())
    missing = [link for link, _ in links if link and "://" not in link and not (path.parent / link).exists()]
    assert not missing, f"{page} links to {missing}"
    for link, anchor in links:
        target = (path.parent / link) if link else path
        if anchor and target.suffix == ".md" and target.is_file():
            assert anchor in _anchors(target), f"{page} links to {link}#{anchor}: no such heading"


def test_main_job_is_the_default_study_and_it_validates():
    """The main job runs the packaged quantgate/studies/quickstart.yaml (its output is committed in
    results/quickstart). Here: the set-up command ends in that study, and the study file is valid."""
    from quantgate.study import DEFAULT_STUDY, load_study

    main_job = next(b.strip() for b in _code_blocks() if b.startswith("pip install") and "pytest" not in b)
    assert main_job.split("&&")[-1].split() == ["quantgate", "study"]
    assert "results/quickstart/report.md" in README and "quantgate/studies/quickstart.yaml" in README
    study = load_study(DEFAULT_STUDY)
    assert {m.name for m in study.models} == {"smollm2-135m", "twin-vanilla", "twin-g1"}
    assert len(study.cells()) == 3 and not any(m.train for m in study.models)  # the twins are loaded, not trained


def test_readme_links_to_the_docs():
    for target in ["docs/getting-started.md", "docs/concepts.md", "docs/guides/", "docs/reference/",
                   "docs/findings.md", "docs/architecture.md"]:  # fmt: skip
        assert f"]({target})" in README, target


STRONG = re.compile(r"no difference|makes? (?:a |no )?difference|reproduc", re.I)
BACKED = re.compile(r"\[[-+]?[\d.,e+x ]+, [-+]?[\d.,e+x ]+\]|larger than [-+]?\d|more than [-+]?\d")


def _claims(page: Path) -> list[str]:
    """The sentences of a hand-written page (code, comments and generated headline blocks left out) that say
    "no difference", "makes a difference" or "reproduces" without an interval or a bound in the same sentence."""
    text = re.sub(r"<!-- headlines:\w+ -->.*?<!-- /headlines -->", "", page.read_text(), flags=re.S)
    return [s for s in _sentences(text) if STRONG.search(s) and not BACKED.search(s)]


def test_no_sentence_claims_more_than_its_interval():
    """Issue 43: "no difference", "makes a difference" and "reproduces" stand only beside the interval or the
    bound ("no difference larger than 0.41 pp") that backs them, on README.md and every hand-written docs page."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts)
    pages = [ROOT / "README.md", ROOT / "experiments" / "README.md", *docs]
    found = {str(p.relative_to(ROOT)): c for p in pages if (c := _claims(p))}
    assert not found, found


def test_the_claim_check_catches_an_unbacked_sentence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "At 8 bits the gate makes no difference. It reproduces Table 2.\n\nNo difference larger than 0.4 pp.\n"
    )
    assert _claims(page) == ["At 8 bits the gate makes no difference.", "It reproduces Table 2."]
