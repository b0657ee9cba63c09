"""Do the main job's SmolLM2 numbers hold in bfloat16? The packaged quickstart study's SmolLM2 entry, run twice
through the study runner on the same documents: in float32 and in bfloat16 (bf16 weights, activations and matmuls;
the quantizers' scale and rounding arithmetic in float32 either way).

    python benchmarks/bf16_eval.py --report results/bench/bf16_eval-smollm2-cpu.md   # ~30 min on 2 cores
    python benchmarks/bf16_eval.py --model tiny-llama --docs 2 --window 64               # seconds (CI)

Per scheme: its change in each dtype and the paired difference of the two changes (bfloat16's minus float32's,
over the same documents); the float models' perplexity, bfloat16 against float32, paired; and the seconds each
step took in each dtype, with their ratio (both measured in this run).

Criterion, declared before the run: bfloat16 holds where the bfloat16 float perplexity is within 1% of float32's
(its paired interval inside +-1%) and every scheme's paired difference of changes lies inside +-(1 pp + 10% of
float32's change): quantization effects of the size the main job reports are told apart the same way in both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantgate.stats import Delta, format_delta, paired_delta, paired_difference, table_head
from quantgate.study import DEFAULT_STUDY, read_metrics, run_study
from quantgate.study.grid import slug
from quantgate.yaml_file import read_yaml, yaml_text

TASK, METRIC = "quantgate_passages", "word_perplexity"  # the main job's SmolLM2 task (quickstart.yaml)
DTYPES = ("float32", "bfloat16")


def study(model: str, docs: int | None, window: int | None) -> dict:
    """The quickstart study's SmolLM2 entry in both dtypes (with ``model`` a preset instead, random weights)."""
    packaged = read_yaml(DEFAULT_STUDY)[0]
    entry = next(m for m in packaged["models"] if m.get("dtype"))
    entry = {k: v for k, v in entry.items() if k not in ("name", "dtype")}
    if model != entry["load"]:
        entry.pop("load")
        entry["preset"] = model
    if docs is not None:
        entry["eval"] = {**entry["eval"], "limit": {TASK: docs}}
    if window is not None:
        entry["eval"] = {**entry["eval"], "max_length": window}
        entry["calibration"] = {**entry["calibration"], "seq_len": window, "batches": 1}
        entry["observe"] = {**entry["observe"], "seq_len": window, "batches": 1}
    return {"name": "bf16_eval", "seed": 0, "models": [{"name": dt, **entry, "dtype": dt} for dt in DTYPES]}


def holds(d: Delta, bound: float) -> bool:
    return d.low is not None and d.high is not None and -bound <= d.low and d.high <= bound


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="the packaged SmolLM2, or a preset (random weights)")
    ap.add_argument("--docs", type=int, help="documents (default: the main job's)")
    ap.add_argument("--window", type=int, help="evaluation window in tokens (default: the main job's)")
    ap.add_argument("--out", default="runs/bf16_eval", help="the study's run directory (resumable)")
    ap.add_argument("--report", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = study(args.model, args.docs, args.window)
    (out / "study.yaml").write_text(yaml_text(spec))
    run_study(out / "study.yaml", out / "run")
    cells = {c.model: c for c in read_metrics(out / "run").cells}
    f32, b16 = (cells[dt] for dt in DTYPES)
    docs = [c.float_documents[TASK] for c in (f32, b16)]
    base = paired_delta(docs[0], docs[1], METRIC)
    steps = lambda c, name: json.loads((c.directory / f"{name}.json").read_text())["seconds"]
    n, works = len(docs[0].ids), len(set(docs[0].works or ()))
    lines = [
        f"# bfloat16 against float32: {args.model}, {n} documents of `{TASK}` ({works} works), the main job's "
        "SmolLM2 settings",
        "",
        f"Command: `python benchmarks/bf16_eval.py{' --model ' + args.model if args.model != 'smollm2-135m' else ''}"
        f"{' --docs ' + str(args.docs) if args.docs else ''}{' --window ' + str(args.window) if args.window else ''}`."
        " Both dtypes ran in this one run, the study runner's step times (seconds).",
        "",
        f"Float perplexity, bfloat16 against float32 (paired): {format_delta(base)}.",
        "",
        *table_head(
            [
                "scheme",
                "float32 change",
                "bfloat16 change",
                "bf16 minus fp32 (paired)",
                "holds",
                "float32 s",
                "bfloat16 s",
                "fp32 / bf16 time",
            ]
        ),
    ]
    verdicts = [holds(base, 0.01)]
    times = [(steps(f32, "eval-float"), steps(b16, "eval-float"))]
    t = times[0]
    lines.append(f"| float | - | - | - | - | {t[0]:.0f} | {t[1]:.0f} | {t[0] / t[1]:.2f}x |")
    for entry in f32.schemes:
        pairs = [(c.float_documents[TASK], c.scheme(entry).documents[TASK]) for c in (f32, b16)]
        changes = [paired_delta(*p, METRIC) for p in pairs]
        gap = paired_difference(pairs[0], pairs[1], METRIC)
        ok = holds(gap, 0.01 + 0.1 * abs(changes[0].value)) if gap.kind == "points" else None
        verdicts.append(bool(ok))
        t = (steps(f32, f"scheme-{slug(entry)}"), steps(b16, f"scheme-{slug(entry)}"))
        times.append(t)
        lines.append(
            f"| `{entry}` | {format_delta(changes[0])} | {format_delta(changes[1])} | {format_delta(gap)} | "
            f"{'yes' if ok else 'no'} | {t[0]:.0f} | {t[1]:.0f} | {t[0] / t[1]:.2f}x |"
        )
    total = [sum(t[i] for t in times) for i in (0, 1)]
    lines += [
        "",
        f"All evaluation steps: {total[0]:.0f} s in float32, {total[1]:.0f} s in bfloat16: "
        f"{total[0] / total[1]:.2f}x. Criterion (declared in the script before its run): "
        + (
            "met: bfloat16 holds."
            if all(verdicts)
            else f"not met for {verdicts.count(False)} of {len(verdicts)} rows (see 'holds')."
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        Path(args.report).write_text(text)


if __name__ == "__main__":
    main()
