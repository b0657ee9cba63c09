#!/usr/bin/env python3
"""Build the bundled accuracy tasks from the held-out TEST split, deterministically.

    python scripts/build_eval_tasks.py        # rewrites quantgate/tasks/data/*.jsonl

Only prose sources are used (Austen's Northanger Abbey, the held-out KJV books, Bierce's letters H
and T): the plays' speaker lines make sentence boundaries unreliable.

* quantgate_cloze (LAMBADA-style last word): a passage of consecutive sentences (50-120 words)
  whose final word is alphabetic, at least 4 letters, and occurs earlier in the passage, so it is
  predictable from the passage, not just from the sentence. The context is the passage up to that
  word; the target is " " + word (its trailing punctuation dropped). Passages do not overlap.
* quantgate_nextsent (4-way multiple choice): two or three consecutive sentences (>= 25 words) as
  context; the true next sentence (5-40 words) and three sentences of similar length (within 50%)
  drawn from other documents of the same source; the answer's position is drawn at random.
Random choices use random.Random(0); 500 items per task, taken evenly across documents.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from quantgate.data import corpus

OUT = Path(__file__).resolve().parents[1] / "quantgate" / "tasks" / "data"
SOURCES = ("austen", "kjv", "devil")
N_ITEMS = 500
_SENTENCE = re.compile(r"(?<=[.!?])[\"'’”)]*\s+(?=[\"'‘“(]*[A-Z])")
_ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Messrs.", "Col.", "Capt.", "Gen.", "Rev.", "viz.", "i.e.", "e.g.")
# cloze targets must carry content: common function words are too easy to guess without the passage
# fmt: off
_FUNCTION_WORDS = {
    "about", "above", "after", "again", "against", "because", "been", "before", "being", "below", "between", "both",
    "could", "does", "doing", "down", "during", "each", "from", "further", "have", "having", "here", "hers", "herself",
    "himself", "into", "itself", "just", "more", "most", "myself", "once", "only", "other", "ought", "over", "same",
    "shall", "should", "some", "such", "than", "that", "their", "theirs", "them", "themselves", "then", "there",
    "these", "they", "this", "those", "through", "under", "until", "upon", "very", "were", "what", "when", "where",
    "which", "while", "whom", "with", "would", "your", "yours", "yourself", "unto", "thee", "thou", "thy", "thine",
    "hath", "doth", "said", "came", "went", "made", "also", "even", "much", "many", "well",
}
# fmt: on


def sentences(text: str) -> list[str]:
    """Sentences of a text: split after . ! ? before a capital, not after Mr. / Mrs. and the like."""
    out: list[str] = []
    for para in text.split("\n\n"):
        pieces = [p.strip() for p in _SENTENCE.split(" ".join(para.split())) if p.strip()]
        for piece in pieces:
            if out and out[-1].endswith(_ABBREVIATIONS) and not out[-1].endswith("\n"):
                out[-1] += " " + piece
            else:
                out.append(piece)
        out[-1:] = [out[-1] + "\n"] if out else []  # a paragraph end is a hard boundary
    return [s.rstrip("\n") for s in out]


def _target(words: list[str]) -> str | None:
    """The passage's last word if it is a cloze target: alphabetic, >= 4 letters, seen earlier."""
    word = re.sub(r"[^A-Za-z]+$", "", words[-1])
    earlier = {re.sub(r"[^a-z]", "", w.lower()) for w in words[:-1]}
    ok = word.isalpha() and len(word) >= 4 and word.lower() in earlier and word.lower() not in _FUNCTION_WORDS
    return word if ok else None


def cloze_items(doc) -> list[dict]:
    sents, items, i = sentences(doc.text), [], 0
    j: int | None  # where the next passage starts; None: after this sentence
    while i < len(sents):
        for j in range(i + 1, len(sents) + 1):
            passage = " ".join(sents[i:j])
            words = passage.split()
            if len(words) > 120:
                j = None
                break
            target = _target(words) if len(words) >= 50 else None
            if target:
                context = passage[: passage.rfind(words[-1])].rstrip()
                items.append({"id": f"{doc.id}#{i}", "context": context, "target": " " + target})
                break
        else:
            j = None
        i = j if j else i + 1  # passages do not overlap
    return items


def nextsent_items(doc, pool: list[str], rng: random.Random) -> list[dict]:
    sents, items, i = sentences(doc.text), [], 0
    while i + 2 < len(sents):
        item = None
        for width in (2, 3):
            if i + width >= len(sents):
                break
            context, nxt = " ".join(sents[i : i + width]), sents[i + width]
            n = len(nxt.split())
            if len(context.split()) >= 25 and 5 <= n <= 40:
                similar = [s for s in pool if 0.5 * n <= len(s.split()) <= 1.5 * n]
                if len(similar) >= 3:
                    choices = rng.sample(similar, 3)
                    label = rng.randrange(4)
                    choices.insert(label, nxt)
                    item = {"id": f"{doc.id}#{i}", "context": context, "choices": choices, "label": label}
                    break
        if item:
            items.append(item)
            i += width + 1
        else:
            i += 1
    return items


def spread(per_doc: list[list[dict]], n: int, rng: random.Random) -> list[dict]:
    """Take n items evenly across documents (round robin), in a fixed order."""
    for items in per_doc:
        rng.shuffle(items)
    out: list[dict] = []
    k = 0
    while len(out) < n and any(k < len(items) for items in per_doc):
        out += [items[k] for items in per_doc if k < len(items)]
        k += 1
    return sorted(out[:n], key=lambda d: d["id"])


def main() -> None:
    docs = [d for d in corpus("test") if d.source in SOURCES]
    rng = random.Random(0)
    cloze = spread([cloze_items(d) for d in docs], N_ITEMS, rng)
    pools = {src: [s for d in docs if d.source == src for s in sentences(d.text)] for src in SOURCES}
    per_doc = []
    for d in docs:
        own = set(sentences(d.text))
        per_doc.append(nextsent_items(d, [s for s in pools[d.source] if s not in own], rng))
    nextsent = spread(per_doc, N_ITEMS, rng)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, items in (("quantgate_cloze", cloze), ("quantgate_nextsent", nextsent)):
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n" for item in items))
        print(f"{path}: {len(items)} items from {len({i['id'].split('#')[0] for i in items})} documents")


if __name__ == "__main__":
    main()
