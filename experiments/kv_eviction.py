"""StreamingLLM-style KV eviction: perplexity with a rolling window, with and without the first 4 tokens.

    python experiments/kv_eviction.py            # results/kv_eviction/
    python experiments/kv_eviction.py --smoke    # seconds: random tiny models (CI)

A rolling KV cache of w recent tokens is an attention mask: query i sees keys i-w+1 .. i, plus keys
0..3 when the sink tokens are kept (Xiao et al. 2024). Positions stay the original ones (RoPE sees
true distances; StreamingLLM re-indexes positions inside the cache instead). Perplexity is over the
second half of each sequence, where every window has evicted tokens; every change of perplexity carries
a 95% paired interval over the sequences (quantgate.stats; approximate below 9 works or sequences).
Models: SmolLM2-135M (ungated, real) on the first 1024 tokens of 24 held-out test documents (one row per
document, taken in turn from each work), and the packaged twins (twin-vanilla and its G1-gated twin-g1:
cpu_recipe's 2-layer d=64 recipe, seed 0; see their model cards) on held-out backcopy sequences.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

import quantgate as qg
from quantgate import experiment as ex
from quantgate.stats import format_delta

SINKS = 4


def sweep(model, ids, windows: list[int]) -> dict:
    """{"full" | "w/keep": per-sequence summed NLL (nats) of the second half of each sequence}."""
    length = ids.shape[1]
    start = length // 2
    rows = {"full": ex.nll(model, ids, start=start).tolist()}
    for w in windows:
        for keep in (0, SINKS):
            mask = ex.window_mask(length, w, keep).expand(ids.shape[0], -1, -1, -1)
            rows[f"{w}/{keep}"] = ex.nll(model, ids, mask, start=start).tolist()
    return rows


def changes(r: dict) -> dict:
    """Paired changes of perplexity: "sinks/w" evicting the sinks (w/0 vs w/4), "w/keep" vs full attention."""
    t, nll = r["tokens_per_sequence"], r["nll"]
    out = {f"sinks/{w}": ex.ppl_change(nll[f"{w}/{SINKS}"], nll[f"{w}/0"], t) for w in r["windows"]}
    return out | {k: ex.ppl_change(nll["full"], v, t) for k, v in nll.items() if k != "full"}


def main() -> None:
    args = ex.script_args(__doc__, "results/kv_eviction")
    t0 = time.perf_counter()
    out = Path(args.out)
    if args.smoke:
        tiny = {v: qg.build("tiny-llama", v) for v in ("vanilla", "g1-elementwise")}
        runs = {f"tiny-llama {v} (random)": (m, "backcopy", 32, 2, [4, 8]) for v, m in tiny.items()}
    else:
        runs = {"smollm2-135m": (qg.load("smollm2-135m"), "test", 1024, 24, [16, 32, 64, 128, 256, 512])}
        runs |= {name: (qg.load(name), "backcopy", 128, 16, [4, 8, 16, 32, 64]) for name in ("twin-vanilla", "twin-g1")}
    results: dict[str, dict[str, Any]] = {}
    for name, (model, source, length, n, windows) in runs.items():
        if source == "backcopy":  # independent sequences of the task's generator
            ids, works = ex.sequences(qg.tokenizer(model), source, length, n, seed=1_000_003), None
        else:  # one row per document: text windows of one packed stream are no independent units
            ids, works = ex.document_starts(qg.tokenizer(model), n, length, source)
        nll, tokens = sweep(model, ids, windows), length - length // 2
        results[name] = {
            "data": source,
            "length": length,
            "sequences": n,
            "works": works,
            "windows": windows,
            "ppl": {k: ex.perplexity(torch.tensor(v), n * tokens) for k, v in nll.items()},
            "nll": nll,
            "tokens_per_sequence": tokens,
            "first_token_attention": ex.first_token_attention(model, ids)[:, :, 1:].mean((1, 2)).tolist(),
        }
        print(name, results[name]["ppl"], flush=True)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "kv_eviction.png")
    lines = ex.header(
        "KV-cache eviction with and without the sink tokens",
        f"python experiments/kv_eviction.py{' --smoke' if args.smoke else ''}",
        seconds,
        "Does a rolling KV cache need the first tokens kept (StreamingLLM), and does a gated model need them less?",
    )
    lines += [
        "Perplexity over the second half of each sequence; 'w / 0' evicts everything older than w tokens, "
        f"'w / {SINKS}' keeps the first {SINKS} tokens too. Evicting the sinks costs: ppl(w / 0) / "
        f"ppl(w / {SINKS}); vs full: the change from full attention. Each with a 95% paired interval over the "
        "sequences (quantgate.stats; ~: the interval includes no change; approximate: too few to decide). "
        "First-token attention: mean over layers, heads and queries of the full-attention model. Trained "
        "models: the packaged twins (their model cards give the training).",
        "",
    ]
    for name, r in results.items():
        sink = sum(r["first_token_attention"]) / len(r["first_token_attention"])
        d = changes(r)
        rows = (
            f"the first {r['length']} tokens of {r['sequences']} documents of {r['data']} from "
            f"{len(set(r['works']))} works"
            if r.get("works")
            else f"{r['sequences']} x {r['length']} tokens of {r['data']}"
        )
        lines += [
            f"### {name} ({rows}; full attention ppl "
            f"{r['ppl']['full']:.3g}; first-token attention {sink:.3f}; max over layers "
            f"{max(r['first_token_attention']):.3f})",
            "",
            f"| window w | ppl, w / 0 | ppl, w / {SINKS} | evicting the sinks costs | w / 0 vs full | "
            f"w / {SINKS} vs full |",
            "|---|---|---|---|---|---|",
        ]
        for w in r["windows"]:
            a, b = r["ppl"][f"{w}/0"], r["ppl"][f"{w}/{SINKS}"]
            lines.append(
                f"| {w} | {a:.3g} | {b:.3g} | {ex.format_ratio(d[f'sinks/{w}'])} | "
                f"{format_delta(d[f'{w}/0'])} | {format_delta(d[f'{w}/{SINKS}'])} |"
            )
        lines.append("")
    lines += ["![kv_eviction.png](kv_eviction.png)", "", "## Reading", ""]
    for name, r in results.items():
        w = r["windows"][0]
        lines.append(
            f"- {name}: at the smallest window ({w}) dropping the first {SINKS} tokens multiplies "
            f"perplexity by {ex.format_ratio(changes(r)[f'sinks/{w}'])} (first-token attention "
            f"{max(r['first_token_attention']):.3f} in its most sink-heavy layer)."
        )
    ex.write(out, lines)
    print((out / "report.md").read_text())


def plot(results: dict, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items(), strict=True):
        ws = r["windows"]
        ax.plot(ws, [r["ppl"][f"{w}/0"] for w in ws], "o-", label="window only")
        ax.plot(ws, [r["ppl"][f"{w}/{SINKS}"] for w in ws], "s-", label=f"window + first {SINKS}")
        ax.axhline(r["ppl"]["full"], color="grey", ls=":", label="full attention")
        ax.set(xscale="log", yscale="log", xlabel="window (tokens)", ylabel="perplexity", title=name)
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    ex.save_figure(fig, path)


if __name__ == "__main__":
    main()
