"""Text sources: the bundled public-domain corpus, and Hugging Face datasets when online.

A source is named by a string:

* ``train`` / ``validation`` / ``test``: the bundled corpus (Austen, Shakespeare, the King James
  Bible, Bierce's Devil's Dictionary; see corpus/PROVENANCE.md), split by work so held-out text is
  prose no model here was trained on;
* ``wikitext-103:<split>``, ``wikitext-2:<split>``, ``bookcorpus-wiki:train`` (Bondarenko et al.'s
  BookCorpus + English Wikipedia mix), or ``hf:<dataset>[@<config>]:<split>[:<text column>]``:
  Hugging Face datasets, downloaded on first use (needs a network, then the datasets cache).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import lzma
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from quantgate.errors import InputError, MissingFile, QuantgateError
from quantgate.files import parse_json

__all__ = [
    "Document",
    "corpus",
    "in_turn",
    "passages",
    "PASSAGE_WORDS",
    "text_hash",
    "document_keys",
    "BUNDLED_SPLITS",
    "DATASETS",
    "OfflineError",
    "hub_reachable",
]

CORPUS_DIR = Path(__file__).with_name("corpus")
BUNDLED_SPLITS = ("train", "validation", "test")

# name -> list of (dataset path, config, text column); a split name is appended by the user
DATASETS: dict[str, list[tuple[str, str | None, str]]] = {
    "wikitext-103": [("Salesforce/wikitext", "wikitext-103-raw-v1", "text")],
    "wikitext-2": [("Salesforce/wikitext", "wikitext-2-raw-v1", "text")],
    "bookcorpus-wiki": [("bookcorpus/bookcorpus", None, "text"), ("wikimedia/wikipedia", "20231101.en", "text")],
}


class OfflineError(QuantgateError, ConnectionError):
    """A source needs the network and none is reachable."""


@dataclass(frozen=True)
class Document:
    id: str
    source: str
    work: str
    title: str
    text: str


def corpus(split: str = "validation") -> Iterator[Document]:
    """Yield the documents of a source (see the module docstring), in a fixed order."""
    if split in BUNDLED_SPLITS:
        yield from _bundled(split)
    elif split.startswith("hf:") or split.split(":")[0] in DATASETS:
        yield from _hf_documents(split)
    else:
        raise InputError(
            f"unknown text source {split!r}; bundled: {', '.join(BUNDLED_SPLITS)}; online: "
            f"{', '.join(f'{d}:<split>' for d in DATASETS)}, hf:<dataset>[@<config>]:<split>"
        )


def in_turn(documents: Iterable[Document]) -> list[Document]:
    """The documents taken in turn from each work (the first of every work, then the second of each, ...),
    so that the first n span min(n, works) works, never n chapters of one."""
    by_work: dict[str, list[Document]] = {}
    for d in documents:
        by_work.setdefault(d.work, []).append(d)
    return [d for round_ in itertools.zip_longest(*by_work.values()) for d in round_ if d is not None]


PASSAGE_WORDS = 256  # the most words in one passage of :func:`passages` (about 340 of SmolLM2's tokens)


def passages(split: str, words: int = PASSAGE_WORDS) -> list[Document]:
    """The bundled ``split``'s documents cut into passages of at most ``words`` words (at word boundaries, the text
    between them kept as written), taken in turn from each work (:func:`in_turn`): the first ``n`` passages hold
    about ``n / works`` passages of every work that has that many, so that no long work (a play's act, a novel's
    chapter) outweighs the others. A passage's id is its document's with ``#i`` (its place in the document)."""
    out = []
    for d in corpus(split):
        spans = [m.span() for m in re.finditer(r"\S+", d.text)]
        for i in range(0, len(spans), words):
            part = spans[i : i + words]
            text = d.text[part[0][0] : part[-1][1]]
            out.append(Document(f"{d.id}#{i // words}", d.source, d.work, d.title, text))
    return in_turn(out)


def text_hash(text: str | bytes) -> str:
    """A document's identity in per-document values: the first 16 hex digits of the SHA-256 of its UTF-8 text
    (or of its bytes: a token sequence's)."""
    return hashlib.sha256(text.encode("utf-8") if isinstance(text, str) else text).hexdigest()[:16]


def document_keys(ids: list, words: list) -> tuple[list[str], list[str]] | None:
    """(the work, the text hash) of each of quantgate_ppl's documents, for per-document values recorded before they
    were kept: ``ids`` are positions in the test split taken in turn from each work (the task's version 2.0) or,
    where the word counts say so, in file order (version 1.0); None where neither order gives every document's
    ``words`` (another corpus: then nothing is guessed)."""
    test = list(corpus("test"))
    for docs in (in_turn(test), test):
        if not all(isinstance(i, int) and 0 <= i < len(docs) for i in ids):
            return None
        picked = [docs[i] for i in ids]
        if [len(re.split(r"\s+", d.text)) for d in picked] == list(words):
            return [d.work for d in picked], [text_hash(d.text) for d in picked]
    return None


@cache
def _bundled(split: str) -> tuple[Document, ...]:
    path = CORPUS_DIR / f"{split}.jsonl.xz"
    if not path.is_file():
        raise MissingFile(
            f"bundled corpus file {path} is missing: reinstall quantgate, or rebuild it with "
            f"python scripts/build_corpus.py"
        )
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return tuple(
            Document(**{k: row[k] for k in ("id", "source", "work", "title", "text")}) for row in map(json.loads, fh)
        )


def hf_spec(source: str) -> tuple[list[tuple[str, str | None, str]], str]:
    """Parse ``name:split`` or ``hf:<dataset>[@<config>]:<split>[:<column>]``."""
    if source.startswith("hf:"):
        parts = source[3:].split(":")
        if len(parts) not in (2, 3) or not all(parts):
            raise InputError(f"hf sources are hf:<dataset>[@<config>]:<split>[:<text column>], got {source!r}")
        path, _, config = parts[0].partition("@")
        return [(path, config or None, parts[2] if len(parts) == 3 else "text")], parts[1]
    name, _, split = source.partition(":")
    if not split:
        raise InputError(f"name the split of {name!r}, e.g. {name}:validation")
    return DATASETS[name], split


def hub_offline() -> bool:
    """Whether the user declared the Hugging Face hub off limits (then only the local caches are read)."""
    return os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers within ``timeout`` seconds, name lookup included (one TCP connection,
    in a daemon thread: a resolver with no network can hang for many seconds). False when declared offline."""
    if hub_offline():
        return False
    answered = []

    def connect():
        try:
            socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def _hf_documents(source: str) -> Iterator[Document]:
    specs, split = hf_spec(source)
    for path, config, column in specs:
        local = Path(path).is_dir()  # a folder of data files: read by datasets with no network
        if not local and not hub_offline() and not hub_reachable():  # before datasets' minute of retries
            raise OfflineError(
                f"text source {source!r} needs the Hugging Face hub ({path}), which is not reachable. "
                f"Offline, use the bundled corpus: {', '.join(BUNDLED_SPLITS)} (or set "
                f"HF_DATASETS_OFFLINE=1 to read a copy already in the datasets cache)"
            )
        import datasets  # datasets: imported at first use of such a source

        quiet = logging.getLogger("datasets")  # its failures become quantgate's one-line errors below, so
        level = quiet.level  # datasets' own log of them (a traceback) is noise
        quiet.setLevel(logging.CRITICAL)
        try:
            # a local folder is read afresh: datasets' own cache is keyed by path and modification time, so a
            # file rewritten with its old time would give the old text (quantgate's caches key its content)
            fresh = {"download_mode": "force_redownload", "verification_mode": "no_checks"} if local else {}
            ds = datasets.load_dataset(path, config, split=split, trust_remote_code=False, **fresh)
        except (ConnectionError, OSError) as e:
            if local:
                raise InputError(f"text source {source!r}: cannot read {path}: {type(e).__name__}: {e}") from None
            raise OfflineError(
                f"text source {source!r} needs the Hugging Face hub ({path}), which is not reachable "
                f"({type(e).__name__}). Offline, use the bundled corpus: "
                f"{', '.join(BUNDLED_SPLITS)}"
            ) from None
        except datasets.exceptions.DatasetGenerationError as e:  # a data file datasets cannot parse
            raise InputError(f"text source {source!r}: {_unreadable(Path(path), e)}") from None
        except RuntimeError:  # a folder holding a dataset script: datasets refuses it, and so does quantgate
            scripts = sorted(p.name for p in Path(path).glob("*.py")) if local else []
            if not scripts:
                raise
            raise InputError(
                f"text source {source!r}: {path} holds a dataset script ({', '.join(scripts)}), code that "
                f"quantgate never runs; give a folder of data files (jsonl, json, csv, parquet or txt)"
            ) from None
        finally:
            quiet.setLevel(level)
        if ds.column_names is not None and column not in ds.column_names:
            raise InputError(
                f"text source {source!r}: {path} has no column {column!r} (it has {', '.join(ds.column_names)}); "
                f"name the text column: hf:{path}:{split}:<column>"
            )
        for i, row in enumerate(ds):
            text = row[column]
            if not isinstance(text, str):
                raise InputError(f"text source {source!r}: row {i} of {path}'s column {column!r} is not text")
            text = text.strip()
            if text:
                yield Document(f"{path}/{split}/{i}", path, path, str(i), text)


def _unreadable(folder: Path, error: Exception) -> str:
    """Why datasets could not read the local data files in ``folder``: the first file that is not UTF-8 text
    (lone surrogates, escaped or raw, included), else datasets' own reason. Names the file; one line."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    for file in files:
        problem = _not_text(file)
        if problem:
            return f"{file} {problem}; fix or remove that file"
    cause: BaseException = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    where = str(folder) if folder.is_dir() else f"dataset {folder}"
    reason = " ".join(str(cause).split())  # one line
    return f"cannot read {where}: {type(cause).__name__}: {reason}"


def _not_text(file: Path) -> str | None:
    """What makes ``file`` not UTF-8 text (None when it is): invalid bytes (a raw surrogate among them), or
    in a JSON file a lone surrogate escape (``"\\ud800"``), which no text column can hold."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start}: {e.reason})"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if file.suffix not in (".json", ".jsonl"):
        return None
    for number, value in _json_values(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            at = f"line {number} " if number else ""
            return f"{at}holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), which is not text"
    return None


def _json_values(text: str) -> list[tuple[int, object]]:
    """The JSON values in ``text`` with their line numbers: one document (line 0), else one per line (JSON
    Lines; lines that do not parse are left to datasets' own message)."""
    try:
        return [(0, parse_json(text))]
    except InputError:
        pass
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            values.append((number, parse_json(line)))
        except InputError:
            continue
    return values
