"""StreamingLLM-style KV eviction: perplexity with a rolling window, with and without the first 4 tokens.

    python experiments/kv_eviction.py            # results/kv_eviction/ (needs results/cpu_recipe: its study)
    python experiments/kv_eviction.py --smoke    # seconds: random tiny models (CI)

A rolling KV cache of w recent tokens is an attention mask: query i sees keys i-w+1 .. i, plus keys
0..3 when the sink tokens are kept (Xiao et al. 2024). Positions stay the original ones (RoPE sees
true distances; StreamingLLM re-indexes positions inside the cache instead). Perplexity is over the
second half of each sequence, where every window has evicted tokens. Models: SmolLM2-135M (ungated,
real) on held-out text, and the tiny ungated / gated models of the cpu_recipe study (seed 0) on
held-out backcopy sequences.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import quantgate as qg
from quantgate import experiment as ex

SINKS = 4


def sweep(model, ids, windows: list[int]) -> dict:
    length = ids.shape[1]
    start = length // 2
    tokens = ids.shape[0] * (length - start)
    full = ex.perplexity(ex.nll(model, ids, start=start), tokens)
    rows = {"full": full}
    for w in windows:
        for keep in (0, SINKS):
            mask = ex.window_mask(length, w, keep).expand(ids.shape[0], -1, -1, -1)
            rows[f"{w}/{keep}"] = ex.perplexity(ex.nll(model, ids, mask, start=start), tokens)
    return rows


def main() -> None:
    args = ex.script_args(__doc__, "results/kv_eviction", **ex.PAIR)
    t0 = time.perf_counter()
    out = Path(args.out)
    if args.smoke:
        tiny = {v: qg.build("tiny-llama", v) for v in ("vanilla", "g1-elementwise")}
        runs = {f"tiny-llama {v} (random)": (m, "backcopy", 32, 2, [4, 8]) for v, m in tiny.items()}
    else:
        runs = {"smollm2-135m": (qg.load("smollm2-135m"), "test", 1024, 4, [16, 32, 64, 128, 256, 512])}
        runs |= {f"cpu_recipe {v}": (m, "backcopy", 128, 16, [4, 8, 16, 32, 64])
                 for v, m in ex.trained_models(args.pair).items()}
    results = {}
    for name, (model, source, length, n, windows) in runs.items():
        ids = ex.sequences(qg.tokenizer(model), source, length, n, seed=1_000_003)
        results[name] = {"data": source, "length": length, "sequences": n, "windows": windows,
                         "ppl": sweep(model, ids, windows),
                         "first_token_attention": ex.first_token_attention(model, ids)[:, :, 1:].mean((1, 2)).tolist()}
        print(name, results[name]["ppl"], flush=True)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "kv_eviction.png")
    lines = ex.header("KV-cache eviction with and without the sink tokens",
                      f"python experiments/kv_eviction.py{' --smoke' if args.smoke else ''}", seconds,
                      "Does a rolling KV cache need the first tokens kept (StreamingLLM), and does a gated model "
                      "need them less?")
    lines += ["Perplexity over the second half of each sequence; 'w / 0' evicts everything older than w tokens, "
              f"'w / {SINKS}' keeps the first {SINKS} tokens too. First-token attention: mean over layers, heads "
              "and queries of the full-attention model. Trained models: seed 0 of the cpu_recipe study (its "
              "report gives tokens trained).", ""]
    for name, r in results.items():
        sink = sum(r["first_token_attention"]) / len(r["first_token_attention"])
        lines += [f"### {name} ({r['sequences']} x {r['length']} tokens of {r['data']}; full attention ppl "
                  f"{r['ppl']['full']:.3g}; first-token attention {sink:.3f}; max over layers "
                  f"{max(r['first_token_attention']):.3f})", "",
                  "| window w | ppl, w / 0 | ppl, w / 4 | evicting the sinks costs |", "|---|---|---|---|"]
        for w in r["windows"]:
            a, b = r["ppl"][f"{w}/0"], r["ppl"][f"{w}/{SINKS}"]
            lines.append(f"| {w} | {a:.3g} | {b:.3g} | {a / b:.2f}x |")
        lines.append("")
    lines += ["![kv_eviction.png](kv_eviction.png)", "", "## Reading", ""]
    for name, r in results.items():
        w = r["windows"][0]
        ratio = r["ppl"][f"{w}/0"] / r["ppl"][f"{w}/{SINKS}"]
        lines.append(f"- {name}: at the smallest window ({w}) dropping the first {SINKS} tokens multiplies "
                     f"perplexity by {ratio:.2f} (first-token attention {max(r['first_token_attention']):.3f} in its "
                     f"most sink-heavy layer).")
    ex.write(out, lines)
    print((out / "report.md").read_text())


def plot(results: dict, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
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
