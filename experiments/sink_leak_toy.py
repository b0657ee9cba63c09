"""Sink leakage: the seed's fixed-gap toy model against the first-token attention SmolLM2-135M shows.

    python experiments/sink_leak_toy.py            # results/sink_leak_toy/{report.md,leak.png,metrics.json}
    python experiments/sink_leak_toy.py --smoke    # seconds: a random tiny model, short contexts (CI)

Toy (seed gated-attention-sigmoid-after-sdpa.txt): a sink with a fixed logit gap D over n - 1 average
tokens holds 1 / (1 + (n - 1) e^-D) of the attention; calibrated to leak 5% at n = 32k it leaks
0.0065, 0.05, 0.174 and 0.628 at 4k, 32k, 128k and 1M. Measured: the first-token attention of each
SmolLM2 layer at query positions n (the query at position n - 1 sees n keys), on held-out text,
and the gap D each layer would need for that share; if D were fixed, as the toy assumes, the share
would fall with n as the toy says.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

import quantgate as qg
from quantgate import experiment as ex

TOY_NS = (4096, 32768, 131072, 1 << 20)
SEED_LEAKS = (0.0065, 0.05, 0.174, 0.628)  # as printed in the seed


def toy_gap(n: int = 32768, leak: float = 0.05) -> float:
    """The logit gap D that makes a sink over n keys leak ``leak`` of the attention."""
    return math.log((n - 1) * (1 - leak) / leak)


def toy_leak(n: int, gap: float) -> float:
    return 1 - 1 / (1 + (n - 1) * math.exp(-gap))


def implied_gap(n: int, share: float) -> float:
    """The gap D for which the toy gives the sink ``share`` at n keys."""
    share = min(max(share, 1e-9), 1 - 1e-9)
    return math.log((n - 1) * share / (1 - share))


def measure(model, tok, length: int, n_seqs: int, probes: list[int]) -> dict:
    """Per layer, the mean first-token attention of the queries at positions n - 1 (n keys) for n in probes."""
    ids = ex.sequences(tok, "test", length, n_seqs)
    mass = ex.first_token_attention(model, ids)  # (layers, B, L)
    return {n: mass[:, :, n - 8 : n].mean((1, 2)).tolist() for n in probes}  # 8 queries ending at n keys


def main() -> None:
    args = ex.script_args(__doc__, "results/sink_leak_toy")
    t0 = time.perf_counter()
    out = Path(args.out)
    gap = toy_gap()
    toy = {n: toy_leak(n, gap) for n in TOY_NS}
    for n, printed in zip(TOY_NS, SEED_LEAKS, strict=True):  # the seed's numbers, to one unit of their last digit
        if abs(toy[n] - printed) >= 10.0 ** -(len(str(printed)) - 2):
            sys.exit(f"toy leak at n={n}: {toy[n]:.4f}, the seed prints {printed}")
    if args.smoke:
        model, name, length, n_seqs = qg.build("tiny-llama"), "tiny-llama (random)", 64, 2
    else:
        model, name, length, n_seqs = qg.load("smollm2-135m"), "smollm2-135m", 8192, 2
    tok = qg.tokenizer(model)
    probes = [n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if n <= length]
    measured = measure(model, tok, length, n_seqs, probes)
    layers = len(next(iter(measured.values())))
    top = sorted(range(layers), key=lambda i: -measured[probes[-1]][i])[:4]
    metrics: dict[str, Any] = {
        "toy": {"gap": gap, "leak": toy, "gap_for_5pct": {n: toy_gap(n) for n in TOY_NS}},
        "model": name,
        "length": length,
        "sequences": n_seqs,
        "first_token_attention": measured,
        "implied_gap": {n: [implied_gap(n, s) for s in measured[n]] for n in probes},
        "top_layers": top,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(metrics, probes, out / "leak.png")
    seconds = time.perf_counter() - t0
    mean = {n: sum(measured[n]) / layers for n in probes}
    lines = ex.header(
        "Sink leakage: a fixed-gap toy vs SmolLM2-135M",
        f"python experiments/sink_leak_toy.py{' --smoke' if args.smoke else ''}",
        seconds,
        "Does a learned sink weaken as context grows, as a fixed logit gap would make it?",
    )
    lines += [
        "## The toy (seed gated-attention-sigmoid-after-sdpa.txt)",
        "",
        f"Gap D = ln(32767 * 0.95 / 0.05) = {gap:.2f} nats (5% leak at n = 32k).",
        "",
        "| n | leak (computed) | leak (seed) | gap for 5% leak |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n:,} | {toy[n]:.4f} | {p} | {toy_gap(n):.2f} |" for n, p in zip(TOY_NS, SEED_LEAKS, strict=True)]
    lines += [
        "",
        f"The seed's 0.628 at 1M is {toy[1 << 20]:.5f} rounded up; to three places it is "
        f"{toy[1 << 20]:.3f}. The other three agree to the printed digits.",
    ]
    lines += [
        "",
        f"## Measured: {name}, {n_seqs} held-out sequences of {length} tokens",
        "",
        "First-token attention (mean over heads and the 8 queries ending at n keys); 'implied gap' is the D "
        "the toy would need to give that share.",
        "",
        "| n keys | mean over layers | "
        + " | ".join(f"layer {i}" for i in top)
        + " | implied gap, "
        + " | ".join(f"layer {i}" for i in top)
        + " |",
        "|---" * (2 + 2 * len(top)) + "|",
    ]
    for n in probes:
        lines.append(
            f"| {n} | {mean[n]:.3f} | "
            + " | ".join(f"{measured[n][i]:.3f}" for i in top)
            + " | "
            + " | ".join(f"{metrics['implied_gap'][n][i]:.2f}" for i in top)
            + " |"
        )
    first, last = probes[0], probes[-1]
    drift = [metrics["implied_gap"][last][i] - metrics["implied_gap"][first][i] for i in top]
    lines += [
        "",
        "![leak.png](leak.png)",
        "",
        "## Reading",
        "",
        f"In the {len(top)} most sink-heavy layers the first-token share goes from "
        + ", ".join(f"{measured[first][i]:.2f} to {measured[last][i]:.2f}" for i in top)
        + f" between {first} and {last} keys. A fixed gap would multiply the non-sink mass by about "
        f"{(last - 1) / (first - 1):.0f}x over that range; the implied gap changes by "
        + ", ".join(f"{d:+.1f}" for d in drift)
        + " nats. "
        + (
            "The model raises its sink logit with context inside its training length, which the toy's fixed "
            "gap does not do; "
            if min(drift) > 1.0
            else "Within a nat, the gap is as fixed as the toy assumes; "
            if max(abs(d) for d in drift) <= 1.0
            else "The layers disagree, so neither a fixed nor a growing gap describes them all; "
        )
        + "beyond the training length nothing keeps the gap growing, and measuring that needs RoPE scaling "
        "(context_extension). Two sequences per length: the curves are noisy at small n.",
    ]
    ex.write(out, lines)
    print((out / "report.md").read_text())


def plot(metrics: dict, probes: list[int], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ns = [2**k for k in range(4, 21)]
    gap = metrics["toy"]["gap"]
    ax.plot(ns, [toy_leak(n, gap) for n in ns], "k-", label=f"toy: fixed gap {gap:.2f} (5% at 32k)")
    for n, leak in metrics["toy"]["leak"].items():
        ax.plot([int(n)], [leak], "ko")
    for i in metrics["top_layers"]:
        shares = [metrics["first_token_attention"][n][i] for n in probes]
        ax.plot(
            probes, [1 - s for s in shares], marker=".", label=f"{metrics['model']} layer {i}: 1 - first-token attn"
        )
        g = implied_gap(probes[0], shares[0])
        ax.plot(ns, [toy_leak(n, g) for n in ns], ls=":", lw=0.8, color=ax.lines[-1].get_color())
    ax.set(
        xscale="log",
        xlabel="keys n",
        ylabel="leak (attention not on the sink)",
        ylim=(0, 1.02),
        title="sink leakage: toy (dotted: fixed gap from the smallest n) vs measured",
    )
    ax.legend(fontsize=7)
    ex.save_figure(fig, path)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
