"""Context extension: perplexity and first-token attention past the training length, with RoPE scaling.

    python experiments/context_extension.py            # results/context_extension/ (needs results/cpu_recipe)
    python experiments/context_extension.py --smoke    # seconds: random tiny models (CI)

The tiny ungated and gated models of the cpu_recipe study (trained on 128-token backcopy sequences,
seed 0) are evaluated on held-out backcopy sequences of 1x to 8x their training length, with RoPE
unchanged, linearly interpolated (factor = length / 128) and YaRN (transformers' rope_parameters).
Qiu et al. find the gate's benefit mostly after YaRN extension; the seed's toy model says a sink
leaks as keys are added. Here: whether the ungated model's sink and perplexity degrade faster. Both
models see the same sequences, so each change of perplexity (gated vs ungated, scaled vs unscaled RoPE)
carries a 95% paired interval over them (quantgate.stats; approximate below 9 sequences).
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

ROPES = ("default", "linear", "yarn")
UNGATED = "vanilla"


def change(a: dict, b: dict):
    """The paired change of perplexity from row ``a`` to row ``b`` (same sequences, same length)."""
    return ex.ppl_change(a["nll"], b["nll"], a["length"] - 1)


def main() -> None:
    args = ex.script_args(__doc__, "results/context_extension", **ex.PAIR)
    t0 = time.perf_counter()
    out = Path(args.out)
    factors: tuple[int, ...]  # context lengths, in trained lengths
    if args.smoke:
        models, trained_len, factors, n = (
            {v: qg.build("tiny-llama", v) for v in ("vanilla", "g1-elementwise")},
            16,
            (1, 2),
            2,
        )
    else:
        models, trained_len, factors, n = ex.trained_models(args.pair), 128, (1, 2, 4, 8), 8
    results: dict[str, dict[str, dict[str, Any]]] = {}
    held_out: dict[int, torch.Tensor] = {}
    for variant, model in models.items():
        tok = qg.tokenizer(model)
        for factor in factors:
            length = trained_len * factor
            ids = ex.sequences(tok, "backcopy", length, n, seed=1_000_003)
            assert torch.equal(held_out.setdefault(length, ids), ids), f"{variant}: other sequences at {length}"
            for rope in ROPES if factor > 1 else ("default",):
                ex.with_rope(model, rope, factor, trained_len)
                sink = ex.first_token_attention(model, ids)  # (layers, B, L)
                last = sink[:, :, -length // 4 :].mean((1, 2))  # the last quarter of the queries
                total = ex.nll(model, ids)
                ppl = ex.perplexity(total, n * (length - 1))
                results.setdefault(variant, {})[f"{length}/{rope}"] = {
                    "length": length,
                    "rope": rope,
                    "ppl": ppl,
                    "nll": total.tolist(),
                    "first_token_attention_last_quarter": last.tolist(),
                }
                print(variant, length, rope, f"ppl {ppl:.3f}", f"sink {float(last.max()):.3f}", flush=True)
        ex.with_rope(model, "default", 1, trained_len)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(
        json.dumps({"trained_len": trained_len, "sequences": n, "results": results}, indent=1)
    )
    plot(results, out / "context_extension.png")
    lines = ex.header(
        "Context extension: gated vs ungated past the training length",
        f"python experiments/context_extension.py{' --smoke' if args.smoke else ''}",
        seconds,
        "Do sinks and perplexity of an ungated model degrade faster than a gated twin's when the "
        "context grows past the training length, with or without RoPE scaling?",
    )
    lines += [
        f"{n} held-out backcopy sequences per length; models trained on {trained_len}-token sequences (the "
        "cpu_recipe study, seed 0). Sink: first-token attention of the last quarter of the queries, the most "
        "sink-heavy layer. Changes of perplexity: on the same sequences, with a 95% interval from a paired "
        "bootstrap over them (~: the interval includes 0).",
        "",
        "| model | length | RoPE | perplexity | vs default RoPE | sink (max layer) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, rows in results.items():
        for r in rows.values():
            vs = change(rows[f"{r['length']}/default"], r) if r["rope"] != "default" else None
            lines.append(
                f"| {variant} | {r['length']} | {r['rope']} | {r['ppl']:.3f} | {format_delta(vs)} | "
                f"{max(r['first_token_attention_last_quarter']):.3f} |"
            )
    gated = [v for v in results if v != UNGATED]
    lines += [
        "",
        "Gated vs ungated: the change of perplexity of the gated model relative to its ungated twin.",
        "",
        "| gated model | length | RoPE | ungated ppl | gated ppl | gated vs ungated |",
        "|---|---|---|---|---|---|",
    ]
    for variant in gated:
        for key, r in results[variant].items():
            u = results[UNGATED][key]
            lines.append(
                f"| {variant} | {r['length']} | {r['rope']} | {u['ppl']:.3f} | {r['ppl']:.3f} | "
                f"{format_delta(change(u, r))} |"
            )
    lines += ["", "![context_extension.png](context_extension.png)", "", "## Reading", ""]
    longest = trained_len * factors[-1]
    for variant, rows in results.items():
        base = rows[f"{trained_len}/default"]
        best = min((r for r in rows.values() if r["length"] == longest), key=lambda r: r["ppl"])
        vs = (
            ""
            if best["rope"] == "default"
            else f" ({format_delta(change(rows[f'{longest}/default'], best))} vs default RoPE)"
        )
        lines.append(
            f"- {variant}: perplexity {base['ppl']:.3f} at {trained_len} tokens; at {longest} the best RoPE "
            f"setting ({best['rope']}) gives {best['ppl']:.3f}{vs}; sink "
            f"{max(base['first_token_attention_last_quarter']):.3f} -> "
            f"{max(best['first_token_attention_last_quarter']):.3f}."
        )
    for variant in gated:
        lines.append(
            f"- {variant} vs {UNGATED} at {longest} tokens: perplexity "
            + ", ".join(
                f"{format_delta(change(results[UNGATED][k], r))} ({r['rope']} RoPE)"
                for k, r in results[variant].items()
                if r["length"] == longest
            )
            + "."
        )
    ex.write(out, lines)
    print((out / "report.md").read_text())


def plot(results: dict, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (variant, rows) in enumerate(results.items()):
        first = min(r["length"] for r in rows.values())
        for j, rope in enumerate(ROPES):  # each curve starts at the training length, where RoPE is unscaled
            pts = sorted((r["length"], r) for r in rows.values() if r["rope"] == rope or r["length"] == first)
            style = {"color": f"C{i}", "ls": ("-", "--", ":")[j], "marker": "."}
            axes[0].plot([p[0] for p in pts], [p[1]["ppl"] for p in pts], label=f"{variant}, {rope}", **style)
            axes[1].plot([p[0] for p in pts], [max(p[1]["first_token_attention_last_quarter"]) for p in pts], **style)
    axes[0].set(xscale="log", yscale="log", xlabel="evaluation length", ylabel="perplexity")
    axes[1].set(xscale="log", xlabel="evaluation length", ylabel="first-token attention (max layer)")
    axes[0].legend(fontsize=7)
    ex.save_figure(fig, path)


if __name__ == "__main__":
    main()
