"""Search for the cheapest CPU setup in which an UNGATED tiny model grows a sink and outliers.

    python experiments/cpu_recipe_search.py            # writes results/cpu_recipe/search.md and search.png
    python experiments/cpu_recipe_search.py --smoke    # seconds: two candidates, a few steps (CI)

Each candidate (a preset, config overrides and training settings on the bigram-backcopy task) is
trained once, ungated, seed 0; the training log's observe passes give first-token attention and the
residual max / median over training. Runs are cached under the output folder (delete to re-run).
The winning candidate becomes experiments/cpu_recipe.yaml, which trains it gated and ungated over
three seeds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import quantgate as qg
from quantgate.train import TrainConfig, train

COMMON: dict[str, Any] = {"data": "backcopy", "batch_size": 16, "seq_len": 128, "eval_batches": 2, "log_every": 25}
CANDIDATES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # name: (preset, overrides, settings)
    "tiny-2L-cosine": ("tiny-llama", {}, {"steps": 800, "lr": 3e-3, "observe_every": 100}),
    "small-4L-cosine": ("small-llama", {}, {"steps": 400, "lr": 1e-3, "observe_every": 50}),
    "tiny-2L-constant-hi": ("tiny-llama", {}, {"steps": 800, "lr": 1e-2, "schedule": "constant", "observe_every": 100}),
}
SMOKE = {
    name: (p, o, {**t, "steps": 6, "observe_every": 3})  # the tiny candidates, a few steps
    for name, (p, o, t) in CANDIDATES.items()
    if p == "tiny-llama"
}


def run(name: str, preset: str, overrides: dict, settings: dict, out: Path) -> dict:
    done = out / "summary.json"
    if done.is_file():
        return json.loads(done.read_text())
    model = qg.build(preset, "vanilla", seed=0, **overrides)
    t0 = time.perf_counter()
    train(model, qg.tokenizer(model), config=TrainConfig(**COMMON, **settings, seed=0, out=str(out / "train")))
    seconds = time.perf_counter() - t0
    recs = [json.loads(line) for line in (out / "train" / "log.jsonl").read_text().splitlines()]
    obs = [r for r in recs if r["event"] == "observe"]
    last = obs[-1]
    summary = {
        "name": name,
        "preset": preset,
        "overrides": overrides,
        "settings": {**COMMON, **settings},
        "seconds": seconds,
        "tokens": [r for r in recs if r["event"] == "train"][-1]["tokens"],
        "final_eval_loss": [r for r in recs if r["event"] == "eval"][-1]["loss"],
        "max_layer_sink": max(L["sink_mass"] for L in last["layers"]),
        "max_median_ratio": last["max_median_ratio"],
        "max_activation": last["max_activation"],
        "curve": [
            {
                "step": r["step"],
                "max_layer_sink": max(L["sink_mass"] for L in r["layers"]),
                "max_median_ratio": r["max_median_ratio"],
            }
            for r in obs
        ],
    }
    done.write_text(json.dumps(summary, indent=1))
    return summary


def write(results: list[dict], out: Path) -> None:
    import matplotlib.pyplot as plt

    lines = [
        "# CPU recipe search: which cheap setup grows a sink in an ungated tiny model?",
        "",
        "Ungated (vanilla) models, seed 0, bigram-backcopy task, batch 16 x 128 tokens; numbers from the last "
        "observe pass of training (held-out backcopy sequences). Target: first-token attention >= 0.3 in some "
        "layer and residual max / median >= 50.",
        "",
        "| candidate | preset, overrides | steps, lr, schedule | tokens | train s | held-out loss | "
        "max layer first-token attn | residual max / median | max activation |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["settings"]
        lines.append(
            f"| {r['name']} | {r['preset']} {r['overrides'] or ''} | {s['steps']}, {s['lr']}, "
            f"{s.get('schedule', 'cosine')} | {r['tokens']:,} | {r['seconds']:.0f} | {r['final_eval_loss']:.3f} | "
            f"{r['max_layer_sink']:.3f} | {r['max_median_ratio']:.1f} | {r['max_activation']:.1f} |"
        )
    (out / "search.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        toks = r["tokens"] / r["settings"]["steps"]
        xs = [c["step"] * toks / 1e6 for c in r["curve"]]
        axes[0].plot(xs, [c["max_layer_sink"] for c in r["curve"]], marker=".", label=r["name"])
        axes[1].plot(xs, [c["max_median_ratio"] for c in r["curve"]], marker=".")
    axes[0].axhline(0.3, color="grey", ls=":")
    axes[1].axhline(50, color="grey", ls=":")
    axes[0].set(xlabel="M tokens", ylabel="max over layers of first-token attention")
    axes[1].set(xlabel="M tokens", ylabel="residual max / median", yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "search.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="results/cpu_recipe")
    ap.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    args = ap.parse_args()
    out = Path(args.out)
    cands = SMOKE if args.smoke else CANDIDATES
    results = [run(n, *cands[n], out / "search" / n) for n in (args.only or cands)]
    write(results, out)
    print((out / "search.md").read_text())


if __name__ == "__main__":
    main()
