"""The retrofit study's sink readout (experiments/retrofit.yaml's criterion, third point): has the gate taken
over the sink's job?

    python experiments/retrofit_readout.py   # reads the four intervention runs below; writes
                                             # results/retrofit/readout.md and readout.json

The four runs, each ``python experiments/massive_activation_intervention.py --model M [--block 11] --out O``
with M the fine-tuned copies (results/retrofit/cells/<cell>/train/model, rebuilt by the study) and O
``results/retrofit/intervention-{vanilla,g1-headwise}[-block11]``: zeroing the massive activations at the block
where each copy's first appear, and at block 11, where the base model's first appear (the copies moved theirs).
Both copies are read on the same 24 documents, so each pair of costs gets a paired interval: the gated copy's
perplexity ratio over the ungated copy's. The declared condition for the further arm: the gated copy's cost
(perplexity change when zeroed) below a tenth of the ungated copy's while its massive activations remain
(|x| > 100 and > 1000 x the median, which observe's "massive" list already requires).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from quantgate import experiment as ex
from quantgate.stats import format_delta, paired_delta, paired_difference

COPIES = {"ungated": "vanilla", "gated": "g1-headwise"}
CELLS = {"vanilla": "smollm2-retrofit--vanilla", "g1-headwise": "smollm2-retrofit--g1-headwise_finetune_true"}
PLACES = {"where each copy's first appear": "", "block 11 (the base model's first)": "-block11"}
SHARE = 0.1  # the declared condition: the gated copy's cost below a tenth of the ungated copy's


def _documents(run: dict, label: str) -> dict:
    """A setting's per-document values, as quantgate.stats reads them."""
    nll = run["results"][label]["nll"]
    return {
        "ids": list(range(len(nll))),
        "loglikelihood": [-x for x in nll],
        "tokens": [run["tokens_per_sequence"]] * len(nll),
    }


def readout(runs: dict[str, dict]) -> dict:
    """Per placement: each copy's block, massive channels and zero-ablation cost, their paired ratio, and whether
    the further arm's condition holds. ``runs``: {"vanilla" | "g1-headwise" + suffix: intervention metrics}."""
    out = {}
    for place, suffix in PLACES.items():
        found = {who: runs[v + suffix] for who, v in COPIES.items() if v + suffix in runs}
        if len(found) < 2:
            continue
        cost = {
            who: paired_delta(_documents(r, "original"), _documents(r, "zero"), "perplexity")
            for who, r in found.items()
        }
        ungated, gated = ((_documents(found[w], "original"), _documents(found[w], "zero")) for w in COPIES)
        pair = paired_difference(ungated, gated, "perplexity")
        remain = bool(found["gated"]["massive"]["channels"])
        out[place] = {
            "block": {w: r["massive"]["layer"] for w, r in found.items()},
            "max_abs": {w: r["massive"]["max_abs"] for w, r in found.items()},
            "cost": cost,
            "pair": pair,
            "massive_remain": remain,
            "condition": remain and cost["gated"].value < SHARE * cost["ungated"].value,
        }
    return out


def main() -> None:
    t0 = time.perf_counter()
    out = Path("results/retrofit")
    runs = {}
    for v in COPIES.values():
        for suffix in PLACES.values():
            folder = out / f"intervention-{v}{suffix}"
            if not (folder / "metrics.json").is_file():
                model = out / "cells" / CELLS[v] / "train" / "model"
                block = " --block 11" if suffix else ""
                sys.exit(
                    f"{folder}/metrics.json is missing: run python experiments/massive_activation_intervention.py "
                    f"--model {model}{block} --out {folder}"
                )
            runs[v + suffix] = json.loads((folder / "metrics.json").read_text())
    result = readout(runs)
    seconds = time.perf_counter() - t0
    lines = ex.header(
        "Retrofit: has the gate taken over the sink's job?",
        "python experiments/retrofit_readout.py",
        seconds,
        "Zeroing the massive activations of each fine-tuned copy (Sun et al.'s intervention; "
        "experiments/massive_activation_intervention.py), read against the criterion declared in "
        "experiments/retrofit.yaml before any run.",
    )
    lines += [
        "Each copy's perplexity change when its massive activations are zeroed, on the first 256 tokens of "
        "the same 24 test documents (9 works), with a 95% paired interval; the gated copy's change against the "
        "ungated copy's, paired over those documents: the ratio of their perplexity ratios where one reaches "
        "10x, else the difference of the changes in points (below 1x, or negative: zeroing costs the gated "
        "copy less).",
        "",
        "| zeroed at | ungated: block, largest abs x | gated: block, largest abs x | ungated cost | "
        "gated cost | gated minus ungated (paired) | further arm's condition |",
        "|---|---|---|---|---|---|---|",
    ]
    for place, r in result.items():
        lines.append(
            f"| {place} | {r['block']['ungated']}, {r['max_abs']['ungated']:.4g} | {r['block']['gated']}, "
            f"{r['max_abs']['gated']:.4g} | {format_delta(r['cost']['ungated'])} | "
            f"{format_delta(r['cost']['gated'])} | {format_delta(r['pair'])} | "
            f"{'met' if r['condition'] else 'not met'} |"
        )
    met = [p for p, r in result.items() if r["condition"]]
    lines += [
        "",
        "## Reading",
        "",
        (
            "The condition holds " + " and ".join(met) + ": the further arm (the gated copy fine-tuned with the "
            "massive channels held at their mean) is due."
            if met
            else "At neither placement does zeroing cost the gated copy less than a tenth of what it costs the ungated "
            "copy, so the declared further arm does not run: the gate has not taken over the sink's job."
        ),
    ]
    (out / "readout.md").write_text("\n".join(lines).rstrip() + "\n")
    (out / "readout.json").write_text(
        json.dumps(
            {
                p: {**r, "cost": {w: vars(d) for w, d in r["cost"].items()}, "pair": vars(r["pair"])}
                for p, r in result.items()
            },
            indent=1,
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
