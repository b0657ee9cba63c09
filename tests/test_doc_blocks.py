"""Every code block of the docs runs in a test: README.md and docs/**/*.md (not docs/reference/, which
scripts/reference_docs.py generates), one test per page (its id: the page's path).

The convention (docs/README.md, "How the docs are tested", says the same to authors):

* A fenced block's language decides what happens to it. ```` ```bash ```` runs with ``bash -euo pipefail -c``
  (600 s at most); ```` ```python ```` runs by ``exec`` in one namespace shared by the page's python blocks, in a
  subprocess (so nothing a page registers leaks into the tests); ```` ```yaml ```` must parse, and one whose top
  level has ``models:`` is a study file, validated by ``quantgate.study.schema.load_study``. ```` ```text ````,
  ```` ```console ````, ```` ```mermaid ```` and untagged blocks (output) are not run. Any other tag fails: the
  author chooses.
* A page's blocks run in order in one fresh working directory (later blocks see the files earlier ones wrote),
  which holds symlinks to the repository's ``experiments``, ``benchmarks``, ``scripts``, ``docs``,
  ``tests/fixtures`` and ``pyproject.toml`` (commands written from the repository root work) but not ``results/``
  (what a command writes there stays in the temporary folder). The environment is the test's (``HOME`` and
  ``QUANTGATE_CACHE`` included: the packaged models' converted weights are reused), plus ``PYTHONPATH`` = the
  repository root.
* An HTML comment on the line(s) right before a block's fence carries its directives, separated by ``;``
  (``\\;`` for a literal one): ``<!-- doc-test: replace smollm2-135m => twin-vanilla; slow -->``.

  - ``replace A => B``: run the block with the literal text A replaced by B (A must occur in it; the prose
    says that the tests run it smaller);
  - ``slow``: run only under ``pytest -m slow`` (the page's ``-slow`` test runs every block, slow ones
    included; the default one leaves them out, so a block that needs what a slow block wrote is slow too);
  - ``skip: REASON``: not run, only for a command a test cannot run (``pip install``, ``vllm serve``,
    ``ray start``, ``torchrun``, ``accelerate launch``, ``python -m pytest``, ``scripts/ecosystem/*.py``, which
    build other tools' venvs); each ``quantgate ...`` command of a skipped (or, by default, slow) bash block
    must still parse with ``quantgate.cli.build_parser()``, so its flags cannot drift;
  - ``file: PATH``: also write the block (after ``replace``) to PATH in the page's working directory, before
    it runs (a study file that the next block runs, say).

  An unknown directive fails, as does a ``doc-test`` comment that is not right before a fence.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from _warm_quantgate import Warm
from conftest import warm_tests

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds, per block
RUN = ("bash", "python")  # executed
VALIDATED = ("yaml",)  # parsed; a study file (top-level models:) is validated by load_study
NOT_RUN = ("", "text", "console", "mermaid")  # output and diagrams
LINKED = ("experiments", "benchmarks", "scripts", "docs", "tests/fixtures", "pyproject.toml")  # never results/
# what a skip: may stand for: the commands a test cannot run
UNRUNNABLE = {
    "pip install": r"\bpip3? install\b",
    "vllm serve": r"\bvllm serve\b",
    "ray start": r"\bray start\b",
    "torchrun": r"\btorchrun\b",
    "accelerate launch": r"\baccelerate launch\b",
    "python -m pytest": r"\bpython3? -m pytest\b|(?:^|[\s;&|(])pytest\b",
    # the ecosystem scripts build the other tools' venvs (pip install) and run them
    "scripts/ecosystem/": r"\bscripts/ecosystem/\w+\.py\b",
}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*?)[ \t]*$")
COMMENT_START = re.compile(r"^[ \t]*<!--[ \t]*doc-test:", re.I)


class DocTestError(ValueError):
    """A page that breaks the convention (an unknown language or directive, a replace that matches nothing...)."""


@dataclass(frozen=True)
class Block:
    """One fenced block of a page, with its directives applied."""

    page: str  # the page, as the messages name it (its path from the repository root)
    line: int  # the line of its opening fence (1-based)
    lang: str
    text: str  # after the replace directives
    directives: tuple[str, ...] = ()
    slow: bool = False
    skip: str | None = None  # the reason
    file: str | None = None  # where file: writes it, relative to the working directory
    study: bool = False  # a yaml block with a top-level models: (load_study validates it)

    @property
    def runs(self) -> bool:
        """Whether the driver executes or validates it (when its page is run with its slow blocks)."""
        return self.skip is None and (self.lang in RUN or self.study)

    def where(self) -> str:
        first = next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "(empty)")
        said = f"; <!-- doc-test: {'; '.join(self.directives)} -->" if self.directives else ""
        return f"{self.page}:{self.line}: the ```{self.lang} block starting `{first}`{said}"


# --- reading a page --------------------------------------------------------------------------------


def split_directives(comment: str) -> list[str]:
    """The ``;``-separated directives of a comment's text (``\\;`` stands for a literal ``;``)."""
    parts = re.split(r"(?<!\\);", comment)
    return [p.replace("\\;", ";").strip() for p in parts if p.strip()]


def _apply(block: dict[str, Any], directive: str) -> None:
    """Apply one directive to ``block`` (a dict of :class:`Block`'s fields being built)."""
    word, _, rest = directive.partition(" ")
    if directive == "slow":
        block["slow"] = True
    elif directive.startswith("skip:") or directive == "skip":
        reason = directive.partition(":")[2].strip()
        if not reason:
            raise DocTestError("skip: needs a reason (skip: installs packages)")
        block["skip"] = reason
    elif directive.startswith("file:"):
        path = directive.partition(":")[2].strip()
        parts = Path(path).parts
        linked = any(parts[: len(Path(p).parts)] == Path(p).parts for p in LINKED)
        if not path or Path(path).is_absolute() or ".." in parts or linked:
            raise DocTestError(
                f"file: {path!r} must be a relative path inside the page's working directory, outside the "
                f"folders linked to the repository ({', '.join(LINKED)})"
            )
        block["file"] = path
    elif word == "replace":
        old, arrow, new = rest.partition("=>")
        old, new = old.strip(), new.strip()
        if not arrow or not old:
            raise DocTestError(f"{directive!r}: write replace OLD => NEW")
        if old not in block["text"]:
            raise DocTestError(f"{directive!r}: {old!r} is not in the block (the block changed?)")
        block["text"] = block["text"].replace(old, new)
    else:
        raise DocTestError(
            f"unknown doc-test directive {directive!r}; valid: replace A => B, slow, skip: REASON, file: PATH"
        )


def parse_page(text: str, page: str) -> list[Block]:
    """The fenced blocks of a markdown page, each with the directives of the comment right before it;
    DocTestError for anything the convention refuses."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[str] = []  # directives waiting for their fence
    pending_end = -1  # the line (0-based) their comment ends on
    i = 0
    while i < len(lines):
        line = lines[i]
        if COMMENT_START.match(line):
            start = i
            while "-->" not in lines[i]:
                i += 1
                if i == len(lines):
                    raise DocTestError(f"{page}:{start + 1}: a doc-test comment without its -->")
            body = " ".join(lines[start : i + 1])
            body = body[body.index("doc-test:") + len("doc-test:") : body.rindex("-->")]
            if pending and pending_end != start - 1:
                raise DocTestError(f"{page}:{pending_end + 1}: a doc-test comment must be right before a fence")
            pending += split_directives(body)
            pending_end = i
            i += 1
            continue
        m = FENCE.match(line)
        if pending and (m is None or pending_end != i - 1):
            raise DocTestError(
                f"{page}:{pending_end + 1}: a doc-test comment must be on the line(s) right before a fence"
            )
        if m is None:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        lang = (m["info"].split() or [""])[0].lower()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise DocTestError(f"{page}:{i + 1}: the ```{lang} block is never closed")
        body = "\n".join(ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in lines[i + 1 : j])
        blocks.append(_block(page, i + 1, lang, body + "\n" if body else "", pending))
        pending, pending_end = [], -1
        i = j + 1
    if pending:
        raise DocTestError(f"{page}:{pending_end + 1}: a doc-test comment must be right before a fence")
    return blocks


def _block(page: str, line: int, lang: str, text: str, directives: list[str]) -> Block:
    at = f"{page}:{line}"
    if lang not in RUN + VALIDATED + NOT_RUN:
        raise DocTestError(
            f"{at}: a ```{lang} block; tag it bash or python (run), yaml (validated) or text, console or "
            f"mermaid (not run)"
        )
    fields: dict[str, Any] = {"page": page, "line": line, "lang": lang, "text": text, "directives": tuple(directives)}
    for directive in directives:
        try:
            _apply(fields, directive)
        except DocTestError as e:
            raise DocTestError(f"{at}: {e}") from None
    if lang in NOT_RUN and (fields.get("slow") or fields.get("skip")):
        raise DocTestError(f"{at}: slow and skip: are for blocks that run; a ```{lang} block never does")
    if fields.get("skip") and fields.get("file"):
        raise DocTestError(f"{at}: a skipped block writes no file: give file: or skip:, not both")
    if fields.get("skip") and not any(re.search(p, fields["text"], re.M) for p in UNRUNNABLE.values()):
        raise DocTestError(
            f"{at}: skip: is only for commands a test cannot run ({', '.join(UNRUNNABLE)}); this block has "
            f"none: let it run (replace, slow)"
        )
    if lang == "yaml":
        try:
            data = yaml.safe_load(fields["text"])
        except yaml.YAMLError as e:
            raise DocTestError(f"{at}: the yaml block does not parse: {e}") from None
        fields["study"] = isinstance(data, dict) and "models" in data
    return Block(**fields)


# --- the commands a block would run: quantgate's must parse -----------------------------------------

_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}


def quantgate_commands(script: str) -> list[list[str]]:
    """The argument lists of the ``quantgate ...`` commands of a shell script (also ``python -m quantgate.cli
    ...`` and ``accelerate launch ... -m quantgate.cli ...``), the words after the command; environment
    assignments before a command and redirections are left out."""
    script = re.sub(r"\\\n", " ", script)  # continuation lines
    found = []
    for line in script.splitlines():
        line = re.sub(r"(?<=\s)\d+(?=>)", "", line)  # 2>err: the descriptor is no argument
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError as e:  # an unclosed quote
            raise DocTestError(f"cannot split the shell line {line!r}: {e}") from None
        segments: list[list[str]] = [[]]
        skip_next = False
        for tok in tokens:
            if skip_next:
                skip_next = False
            elif tok in _SEPARATORS:
                segments.append([])
            elif set(tok) <= set("<>&|") and ("<" in tok or ">" in tok):
                skip_next = True  # a redirection and its target
            else:
                segments[-1].append(tok)
        for words in segments:
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                words = words[1:]
            if words and words[0] == "quantgate":
                found.append(words[1:])
            elif "-m" in words and words.index("-m") + 1 < len(words):
                k = words.index("-m")
                if words[k + 1] in ("quantgate", "quantgate.cli") and words[0] in ("python", "python3", "accelerate"):
                    found.append(words[k + 2 :])
    return found


@cache
def _parser() -> Any:
    """quantgate's parser, refusing abbreviated flags (``--smok`` for ``--smoke``): the docs spell them out."""
    import argparse

    from quantgate.cli import build_parser

    parser = build_parser()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        p.allow_abbrev = False
        parsers += [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
    return parser


def check_commands(block: Block) -> None:
    """Raise DocTestError where a ``quantgate`` command of a bash block that is not run does not parse."""
    if block.lang != "bash":
        return
    for args in quantgate_commands(block.text):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                _parser().parse_args(args)
        except SystemExit as e:
            if e.code not in (0, None):  # --help and --version exit 0
                said = err.getvalue().strip().splitlines()
                raise DocTestError(
                    f"{block.where()}: `quantgate {shlex.join(args)}` does not parse: {said[-1] if said else e}"
                ) from None


# --- running a page --------------------------------------------------------------------------------


class DocBlockFailed(AssertionError):
    """A block that failed (its page, line, first line, directives and output tail are the message)."""


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def prepare(work: Path, root: Path = ROOT) -> None:
    """A page's working directory: the repository's folders a command may name, linked; results/ not."""
    work.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        target = root / name
        if target.exists():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).symlink_to(target)


def page_env() -> dict[str, str]:
    """The environment a page runs in: the test's, plus ``PYTHONPATH`` = the repository root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_page(page: Path, tmp: Path, slow: bool = False, warm: Warm | None = None, prelude: str = "") -> list[Block]:
    """Run ``page``'s blocks in order (``slow``: its slow blocks too) in ``tmp``/work; raise DocTestError where
    the page breaks the convention and DocBlockFailed at the first block that fails. Returns the blocks run.
    ``warm``: its server forks the driver and each ``quantgate`` command (tests/_warm_quantgate.py), which then
    skip the package's import. ``prelude``: source the driver runs first (benchmarks/warm_tests.py's in-process
    commands)."""
    blocks = parse_page(page.read_text(encoding="utf-8"), relative(page))
    for block in blocks:
        if block.skip or (block.slow and not slow):
            check_commands(block)  # not run here: its commands must parse still
    plan = [b for b in blocks if not b.skip and (slow or not b.slow) and (b.runs or b.file)]
    if not plan:
        return []
    work, logs = tmp / "work", tmp / "logs"
    prepare(work)
    logs.mkdir(parents=True, exist_ok=True)
    spec = logs / "spec.json"
    spec.write_text(json.dumps({"blocks": [asdict(b) for b in plan], "logs": str(logs), "work": str(work)}))
    env = page_env()
    boot = prelude + textwrap.dedent(_drive_source()) + "\nimport sys\n_drive(sys.argv[1])\n"
    command = [sys.executable, "-c", boot, str(spec)]
    if warm is not None and warm.env is not None:  # the pages' server: its environment has the client on PATH
        env = {**env, "PATH": warm.env["PATH"]}
        command = warm.python(["-c", boot, str(spec)])
    proc = subprocess.Popen(
        command,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=(logs / "driver.out").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a timeout ends the driver and every process a block started
    )
    try:
        proc.wait(timeout=TIMEOUT * len(plan) + 120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    results = json.loads((logs / "results.json").read_text()) if (logs / "results.json").is_file() else []
    for block, result in zip(plan, results, strict=False):
        if not result["ok"]:
            raise DocBlockFailed(_failure(block, result))
    if len(results) < len(plan):  # the driver itself died, or ran out of time
        block = plan[len(results)]
        tail = (logs / "driver.out").read_text(errors="replace")[-3000:]
        raise DocBlockFailed(f"{block.where()}: the driver stopped (exit {proc.returncode}) during it:\n{tail}")
    return plan


def _failure(block: Block, result: dict[str, Any]) -> str:
    lines = [f"{block.where()}: {result['why']}"]
    for stream in ("stderr", "stdout"):
        tail = result[stream].rstrip()
        if tail:
            lines += [f"--- {stream} (last lines) ---", tail]
    return "\n".join(lines)


@cache
def _drive_source() -> str:
    import inspect

    return inspect.getsource(_drive)


def _drive(spec_path: str) -> None:
    """The driver, run as ``python -c`` in the page's working directory: each block of the spec in order (bash in
    its own ``bash -euo pipefail``, python by exec in one namespace, a study file by load_study), results.json
    rewritten after each, stopping at the first failure. Self-contained: its source is what runs."""
    import builtins
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    import traceback
    from pathlib import Path

    spec = json.loads(Path(spec_path).read_text())
    logs, work, timeout = Path(spec["logs"]), Path(spec["work"]), 600
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    results: list[dict] = []

    def tail(path: Path, lines: int = 40) -> str:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])[-4000:]

    def alarm(signum, frame):
        raise TimeoutError(f"the block ran past {timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    for n, block in enumerate(spec["blocks"]):
        os.chdir(work)
        out, err = logs / f"{n}.stdout", logs / f"{n}.stderr"
        target = work / (block["file"] or f"doc-test-block-{n}.yaml")
        if block["file"]:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block["text"])
        ok, why, start = True, "", time.monotonic()
        with out.open("w") as o, err.open("w") as e:
            if block["lang"] == "bash":
                proc = subprocess.Popen(
                    ["bash", "-euo", "pipefail", "-c", block["text"]],
                    stdin=subprocess.DEVNULL,
                    stdout=o,
                    stderr=e,
                    start_new_session=True,
                )
                try:
                    code = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code, why = -9, f"timed out after {timeout} s"
                ok = code == 0
                why = why or f"bash exited with status {code}"
            elif block["lang"] in ("python", "yaml") and (block["lang"] == "python" or block["study"]):
                sys.stdout.flush()
                sys.stderr.flush()
                saved = os.dup(1), os.dup(2)
                os.dup2(o.fileno(), 1)
                os.dup2(e.fileno(), 2)
                signal.alarm(timeout)
                try:
                    if block["lang"] == "python":
                        source = "\n" * (block["line"]) + block["text"]  # tracebacks give the page's line numbers
                        exec(compile(source, block["page"], "exec"), namespace)
                    else:
                        from quantgate.study.schema import load_study

                        if not block["file"]:  # beside the page's files: relative paths in it resolve as there
                            target.write_text(block["text"])
                        load_study(target)
                except SystemExit as stop:
                    if stop.code not in (0, None):
                        ok, why = False, f"SystemExit({stop.code!r})"
                except BaseException as exc:
                    ok, why = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
                    traceback.print_exc()
                finally:
                    signal.alarm(0)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
                    os.close(saved[0])
                    os.close(saved[1])
        results.append(
            {"ok": ok, "why": why, "stdout": tail(out, 15), "stderr": tail(err), "seconds": time.monotonic() - start}
        )
        (logs / "results.json").write_text(json.dumps(results))
        if not ok:
            break
    (logs / "results.json").write_text(json.dumps(results))


# --- the pages -------------------------------------------------------------------------------------


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and docs/**/*.md, less the generated docs/reference/."""
    reference = root / "docs" / "reference"
    pages = [p for p in sorted((root / "docs").rglob("*.md")) if not p.is_relative_to(reference)]
    return [root / "README.md", *pages] if (root / "README.md").is_file() else pages


def page_params(pages: list[Path]) -> list[Any]:
    """One test per page (id: its path); a page with slow blocks has a second, marked slow, that runs them too."""
    params = []
    for page in pages:
        rel = relative(page)
        params.append(pytest.param(page, False, id=rel))
        try:
            slow = any(b.slow for b in parse_page(page.read_text(encoding="utf-8"), rel))
        except DocTestError:  # the default test says why
            slow = False
        if slow:
            params.append(pytest.param(page, True, id=f"{rel}-slow", marks=pytest.mark.slow))
    return params


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory) -> Iterator[Warm | None]:
    """The warm quantgate (tests/_warm_quantgate.py), None where it cannot start."""
    server = Warm(tmp_path_factory.mktemp("warm"), page_env(), shim=True)
    yield server if server.start() else None
    server.stop()


@pytest.fixture
def warm(request) -> Warm | None:
    """The warm quantgate for the pages; None (they run cold, each command paying its own import) where it cannot
    start or where conftest.warm_tests says not."""
    return request.getfixturevalue("warm_server") if warm_tests() else None


@pytest.mark.parametrize(("page", "slow"), page_params(doc_pages()))
def test_page(page: Path, slow: bool, tmp_path: Path, warm: Warm | None) -> None:
    failure = None
    try:
        run_page(page, tmp_path, slow=slow, warm=warm)
    except (DocTestError, DocBlockFailed) as e:
        failure = str(e)
    if failure is not None:  # outside the except: the message alone, not chained to the exception
        pytest.fail(failure, pytrace=False)


# --- the runner's own tests, on pages written here -------------------------------------------------


def _page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    page = tmp_path / "pages" / name
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(textwrap.dedent(text))
    return page


def test_blocks_run_in_order_in_one_directory_and_namespace(tmp_path):
    page = _page(
        tmp_path,
        """\
        # A page

        ```python
        answer = 41
        open("from-python.txt", "w").write("hello")
        ```

        Some prose; an output block is not run:

        ```
        this is output, not a command
        ```

        ```bash
        test "$(cat from-python.txt)" = hello
        echo bye > from-bash.txt
        ```

        ```python
        assert answer + 1 == 42 and open("from-bash.txt").read() == "bye\\n"
        import sys
        sys.doc_test_marker = True
        ```
        """,
    )
    ran = run_page(page, tmp_path / "run")
    assert [b.lang for b in ran] == ["python", "bash", "python"]
    assert not hasattr(sys, "doc_test_marker")  # the blocks ran in a subprocess
    assert (tmp_path / "run" / "work" / "from-bash.txt").read_text() == "bye\n"


def test_the_working_directory_links_the_repository_but_not_results(tmp_path):
    page = _page(
        tmp_path,
        """\
        ```bash
        test -d experiments && test -d scripts && test -d docs && test -d tests/fixtures && test -f pyproject.toml
        test ! -e results
        mkdir -p results/x && touch results/x/metrics.json
        case ":$PYTHONPATH:" in *":$ROOT:"*) ;; *) echo "PYTHONPATH=$PYTHONPATH" >&2; exit 1 ;; esac
        ```
        """.replace("$ROOT", str(ROOT)),
    )
    run_page(page, tmp_path / "run")
    assert (tmp_path / "run" / "work" / "results" / "x" / "metrics.json").is_file()
    assert not (ROOT / "results" / "x").exists()


def test_a_failing_python_block_fails_its_page_with_its_traceback(tmp_path):
    page = _page(
        tmp_path,
        """\
        ```python
        x = 1
        ```

        <!-- doc-test: replace 2 => 3 -->
        ```python
        y = 2
        raise RuntimeError("the example broke")
        ```

        ```bash
        echo never > never.txt
        ```
        """,
    )
    with pytest.raises(DocBlockFailed) as failed:
        run_page(page, tmp_path / "run")
    message = str(failed.value)
    assert message.startswith("page.md:6: the ```python block starting `y = 3`; <!-- doc-test: replace 2 => 3 -->")
    assert "RuntimeError: the example broke" in message
    assert 'File "page.md", line 8' in message  # the traceback points into the markdown
    assert not (tmp_path / "run" / "work" / "never.txt").exists()  # the page stops at its first failure


def test_a_failing_bash_block_shows_its_stderr(tmp_path):
    page = _page(
        tmp_path,
        """\
        ```bash
        echo "this went wrong" >&2
        false | true
        echo "pipefail let it through"
        ```
        """,
    )
    with pytest.raises(DocBlockFailed, match=r"(?s)bash exited with status 1.*this went wrong"):
        run_page(page, tmp_path / "run")


def test_replace_applies_before_the_block_runs(tmp_path):
    page = _page(
        tmp_path,
        """\
        The tests run this on a smaller model.

        <!-- doc-test: replace smollm2-135m => twin-vanilla;
             replace --budget 10m => --budget 1m -->
        ```bash
        echo quantgate audit smollm2-135m --budget 10m > said.txt
        ```
        """,
    )
    (block,) = run_page(page, tmp_path / "run")
    assert block.directives == ("replace smollm2-135m => twin-vanilla", "replace --budget 10m => --budget 1m")
    assert (tmp_path / "run" / "work" / "said.txt").read_text() == "quantgate audit twin-vanilla --budget 1m\n"


def test_a_replace_that_matches_nothing_fails():
    with pytest.raises(DocTestError, match="'smollm2' is not in the block"):
        parse_page("<!-- doc-test: replace smollm2 => twin -->\n```bash\necho twin\n```\n", "p.md")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("```sh\necho hi\n```\n", r"p.md:1: a ```sh block; tag it bash or python"),
        ("```json\n{}\n```\n", r"a ```json block"),
        ("<!-- doc-test: fast -->\n```bash\necho hi\n```\n", r"p.md:2: unknown doc-test directive 'fast'"),
        ("<!-- doc-test: slow -->\n\n```bash\necho hi\n```\n", r"p.md:1: a doc-test comment must be .*before a fence"),
        ("<!-- doc-test: slow -->\nprose\n", r"must be on the line\(s\) right before a fence"),
        ("<!-- doc-test: skip: no GPU -->\n```bash\nquantgate study\n```\n", r"skip: is only for commands"),
        ("<!-- doc-test: skip -->\n```bash\npip install x\n```\n", r"skip: needs a reason"),
        ("<!-- doc-test: slow -->\n```text\noutput\n```\n", r"a ```text block never does"),
        ("<!-- doc-test: file: /etc/x.yaml -->\n```yaml\na: 1\n```\n", r"must be a relative path"),
        ("<!-- doc-test: file: docs/x.md -->\n```text\nx\n```\n", r"outside the folders linked"),
        ("<!-- doc-test: file: tests/fixtures/x -->\n```text\nx\n```\n", r"outside the folders linked"),
        ("```yaml\na: [1\n```\n", r"the yaml block does not parse"),
        ("```bash\necho hi\n", r"never closed"),
    ],
)
def test_the_convention_refuses(text, error):
    with pytest.raises(DocTestError, match=error):
        parse_page(text, "p.md")


def test_directives_and_fences_are_read():
    text = textwrap.dedent(
        """\
        <!-- an ordinary comment -->
        <!-- doc-test: slow; replace a\\;b => c -->
        ```Python title="x"
        print("a;b")
        ```

        1. In a list:

           ```bash
           echo indented
           ```

        ````text
        ```bash
        <!-- doc-test: anything, inside a block, is text -->
        ```
        ````
        """
    )
    first, second, third = parse_page(text, "p.md")
    assert (first.lang, first.slow, first.text, first.line) == ("python", True, 'print("c")\n', 3)
    assert (second.lang, second.text, second.slow) == ("bash", "echo indented\n", False)
    assert third.lang == "text" and "doc-test: anything" in third.text and not third.runs


def test_a_skipped_quantgate_command_must_parse(tmp_path):
    good = "quantgate study experiments/x.yaml --smoke"
    ok = f"<!-- doc-test: skip: installs packages -->\n```bash\npip install -e . && {good}\n```\n"
    assert run_page(_page(tmp_path, ok, "ok.md"), tmp_path / "ok") == []
    bad = _page(tmp_path, ok.replace("--smoke", "--smok"), "bad.md")
    with pytest.raises(DocTestError, match=r"`quantgate study experiments/x.yaml --smok` does not parse"):
        run_page(bad, tmp_path / "bad")


def test_quantgate_commands_are_found_in_a_shell_script():
    script = textwrap.dedent(
        """\
        pip install -e . && quantgate study a.yaml --out b 2>err.log | tee log  # a comment
        RAY_ADDRESS=ray://head:10001 quantgate study q.yaml \\
          --executor ray
        accelerate launch --num_processes 2 -m quantgate.cli train --preset tiny-llama --steps 4 > /dev/null
        echo "quantgate is not a command here"; quantgate report runs/x
        """
    )
    assert quantgate_commands(script) == [
        ["study", "a.yaml", "--out", "b"],
        ["study", "q.yaml", "--executor", "ray"],
        ["train", "--preset", "tiny-llama", "--steps", "4"],
        ["report", "runs/x"],
    ]


def test_a_slow_block_runs_only_under_the_slow_mark(tmp_path):
    page = _page(
        tmp_path,
        """\
        ```bash
        echo fast > fast.txt
        ```

        <!-- doc-test: slow -->
        ```bash
        exit 3
        ```
        """,
    )
    (default, slow) = page_params([page])
    assert default.id == "page.md" and not default.marks
    assert slow.id == "page.md-slow" and [m.name for m in slow.marks] == ["slow"]
    assert [b.lang for b in run_page(page, tmp_path / "default")] == ["bash"]
    with pytest.raises(DocBlockFailed, match="bash exited with status 3"):
        run_page(page, tmp_path / "slow", slow=True)
    assert (tmp_path / "slow" / "work" / "fast.txt").is_file()  # the slow run ran the page from its start


def test_a_study_file_is_validated_and_file_writes_it(tmp_path, warm):
    page = _page(
        tmp_path,
        """\
        <!-- doc-test: file: study.yaml -->
        ```yaml
        models:
          - preset: tiny-llama
        schemes: [w8-int8]
        ```

        ```yaml
        not_a_study: [1, 2]
        ```

        ```bash
        test -f study.yaml
        ```

        ```yaml
        models:
          - preset: tiny-llama
            sedes: [0]
        ```
        """,
    )
    with pytest.raises(DocBlockFailed) as failed:
        run_page(page, tmp_path / "run", warm=warm)
    message = str(failed.value)
    assert message.startswith("page.md:16: the ```yaml block starting `models:`")
    assert "unknown key 'sedes'" in message


def test_every_page_is_collected():
    pages = [relative(p) for p in doc_pages()]
    assert pages[0] == "README.md" and "docs/architecture.md" in pages
    assert not [p for p in pages if p.startswith("docs/reference/")]


# --- the warm quantgate (tests/_warm_quantgate.py) ---------------------------------------------------------------


def test_a_warm_command_prints_writes_and_exits_as_the_executable_does(warm_server, tmp_path):
    """Each ``quantgate`` command of a page is a child forked from the warm server: its output, its working
    directory, its exit status and its one-line error are the executable's."""
    import quantgate

    assert warm_server is not None  # the pages run warm on this machine
    warm = warm_server
    page = _page(
        tmp_path,
        """\
        ```bash
        mkdir sub && cd sub && quantgate --version > version.txt
        status=0; quantgate audit twin-vanilla --docs 0 2> err.txt || status=$?
        echo "$status" > status.txt
        ```
        """,
    )
    run_page(page, tmp_path / "run", warm=warm)
    sub = tmp_path / "run" / "work" / "sub"
    assert (sub / "version.txt").read_text() == f"quantgate {quantgate.__version__}\n"
    assert (sub / "status.txt").read_text() == "2\n"
    assert (sub / "err.txt").read_text().strip().splitlines()[-1] == (
        "quantgate audit: error: --docs 0: give a whole number of passages (or batches) of at least 1"
    )
    log = (warm.folder / "server.log").read_text()
    assert f"{warm.real} --version" in log and f"{warm.real} audit twin-vanilla" in log
