"""NVIDIA ModelOpt's recipe search (``mtq.auto_quantize``) beside quantgate's measurement, on SmolLM2-135M.

ModelOpt picks, per layer group, INT8 (``INT8_DEFAULT_CFG``: INT8 weights per output channel, per-tensor static
INT8 activations) or "leave unquantized" under an effective-bits budget, scoring each group by the gradient
method (sum((dL/dY * (Q(Y) - Y))^2) on calibration batches) and solving an LP. It never evaluates the result.
This script runs that search and then reads each recipe's perplexity change with quantgate's paired 95%
interval, quantizing with ``w8a8-int8-static:keep=NAME1|NAME2|...`` (the modules ModelOpt leaves unquantized).

Three steps, two Pythons (ModelOpt pins transformers < 5.15; quantgate needs >= 5.24):

1. ``python benchmarks/anchor_modelopt.py prepare --work W``: in quantgate's Python. Saves SmolLM2-135M as a
   plain transformers folder (``W/float``) and dumps quantgate's own calibration rows (train split, 128 tokens,
   batches of 8: what ``quantgate eval --scheme`` calibrates on) to ``W/calib.json``. About 10 s once the
   packaged GGUF is converted (the first ``qg.load`` converts it, about 40 s).
2. ``/work/venvs/modelopt/bin/python benchmarks/anchor_modelopt.py search --work W``: in ModelOpt's venv
   (``python3 -m venv /work/venvs/modelopt && /work/venvs/modelopt/bin/pip install torch==2.13.0 &&
   /work/venvs/modelopt/bin/pip install nvidia-modelopt==0.47.0 "transformers<5.15" requests``). One
   ``auto_quantize`` run (calibration + gradient scoring + LP) at the first ``--bits``, then
   ``mtq.get_auto_quantize_config`` re-solves the same scores for every ``--bits``. Writes ``W/search.json``.
   With the defaults (16 calibration and 16 scoring batches of 8 x 128 tokens) it took 1,095 s on 2 CPU cores
   shared with another engineer's jobs (calibration 84 s, gradient scoring 1,009 s, 63 s a batch on average; each
   re-solve under 0.1 s); ``--calib-steps 2 --score-steps 2`` took 83 s on quieter cores.
3. ``python benchmarks/anchor_modelopt.py measure --work W --out results/bench/anchor-smollm2-cpu.json``: in
   quantgate's Python. ``quantgate eval`` (quantgate_ppl, ``--limit 18``, bfloat16) of the float model and of
   each distinct recipe, then ``quantgate compare`` for the paired change and its interval: the float model,
   the scheme without keeps, then each distinct recipe, once per ``--schemes`` entry. Each evaluation took
   407-581 s on the shared cores. Resumable: a run with its ``seconds.json`` is not run again; ``--collect``
   starts none and writes what the runs in ``W`` hold, the rest marked not measured.

Set ``QUANTGATE_PYTHONPATH`` (default: none) to run steps 1 and 3 on a quantgate source tree other than the
installed one (e.g. an unpacked ``git archive HEAD``), and ``ANCHOR_THREADS`` to cap torch's threads.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m"
BITS = (8.1, 8.25, 8.5, 9.0, 10.0, 12.0)
SCHEMES = ("w8a8-int8-static",)  # quantgate schemes each recipe's keeps are applied to


def _threads() -> None:
    import torch

    n = os.environ.get("ANCHOR_THREADS")
    if n:
        torch.set_num_threads(int(n))


# ---------------------------------------------------------------------------------------------- prepare


def prepare(work: Path, calib_batches: int) -> None:
    """quantgate's side: the float folder and quantgate's calibration rows (token ids)."""
    import quantgate as qg
    from quantgate.data.batches import batches
    from quantgate.eval.load import CALIB_BATCH_SIZE, CALIB_SEQ_LEN, CALIB_SOURCE
    from quantgate.models.sources import tokenizer

    _threads()
    work.mkdir(parents=True, exist_ok=True)
    model = qg.load(MODEL)
    tok = tokenizer(model)
    model.save_pretrained(work / "float")  # type: ignore[operator]  # a transformers model
    tok.save_pretrained(work / "float")
    data = batches(tok, CALIB_SOURCE, CALIB_SEQ_LEN, CALIB_BATCH_SIZE)
    rows = []
    for i, b in enumerate(data):
        if i == calib_batches:
            break
        rows.append(b["input_ids"].tolist())
    (work / "calib.json").write_text(
        json.dumps(
            {
                "source": CALIB_SOURCE,
                "seq_len": CALIB_SEQ_LEN,
                "batch_size": CALIB_BATCH_SIZE,
                "quantgate": qg.__file__,
                "batches": rows,
            }
        )
    )
    print(f"wrote {work / 'float'} and {work / 'calib.json'} ({len(rows)} batches)")


# ----------------------------------------------------------------------------------------------- search


def search(
    work: Path, bits: list[float], calib_steps: int, score_steps: int, exclude_head: bool, skip: int, out: Path
) -> None:
    """ModelOpt's side (its venv): one auto_quantize, then a re-solve per effective-bits target."""
    import importlib.metadata as md
    import platform

    import modelopt.torch.quantization as mtq  # type: ignore[import-not-found]  # its own venv
    import torch
    from modelopt.torch.quantization.algorithms import QuantRecipe  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM

    _threads()
    torch.manual_seed(0)
    calib = json.loads((work / "calib.json").read_text())
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in (torch.tensor(b, dtype=torch.long) for b in calib["batches"][skip:])
    ]
    need = max(calib_steps, score_steps)
    if len(data) < need:
        raise SystemExit(f"{work / 'calib.json'} holds {len(data)} batches; {need} needed")
    model = AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32)
    model.config.use_cache = False
    linears = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    # effective bits over the searched Linears: by default the disabled LM head counts at 16 bits in the
    # denominator (SmolLM2's tied 49152 x 576 head: no target below 9.6842 is feasible), so leave it out
    cost = {"excluded_module_name_patterns": ["*lm_head*"]} if exclude_head else {}
    t0 = time.perf_counter()
    model, state = mtq.auto_quantize(
        model,
        constraints={"effective_bits": bits[0], **({"cost": cost} if cost else {})},
        quantization_formats=[mtq.INT8_DEFAULT_CFG],
        data_loader=data,
        forward_step=lambda m, b: m(**b),
        loss_func=lambda out, b: out.loss,
        method="gradient",
        disabled_layers=["*lm_head*"],
        num_calib_steps=calib_steps,
        num_score_steps=score_steps,
        verbose=True,
    )
    search_s = time.perf_counter() - t0

    none = QuantRecipe(quant_cfg=None)
    stats = state["candidate_stats"]
    total = sum(s["uncompressed_cost"] for s in stats.values())

    searched = {name for name, s in stats.items() if len(s["formats"]) > 1}  # the head has "none" alone

    def recipe_of(best: dict) -> dict:
        kept = sorted(
            (m for name, fmt in best.items() if fmt == none and name in searched for m in stats[name]["module_names"]),
            key=_layer_order,
        )
        cost = sum(s["costs"][s["formats"].index(best[name])] for name, s in stats.items())
        return {"unquantized": kept, "effective_bits": cost / total * 16}

    first = recipe_of(state["best"]["recipe"])
    first.update(
        target=bits[0],
        effective_bits_reported=state["best"]["constraints"]["effective_bits"],
        is_satisfied=bool(state["best"]["is_satisfied"]),
        seconds=search_s,
        how="auto_quantize",
    )
    recipes = [first]
    for b in bits:
        t0 = time.perf_counter()
        cfg = mtq.get_auto_quantize_config(state, {"effective_bits": b})
        s = time.perf_counter() - t0
        from modelopt.torch.quantization.algorithms import _resolve_best_recipe

        r = recipe_of(_resolve_best_recipe(state, {"effective_bits": b}))  # the same solve, for the formats
        enabled = {e["quantizer_name"].rsplit(".", 1)[0] for e in cfg["quant_cfg"] if e.get("enable", True)}
        searchable = [m for n in searched for m in stats[n]["module_names"]]
        from_cfg = sorted((m for m in searchable if m not in enabled), key=_layer_order)
        if from_cfg != r["unquantized"]:
            raise SystemExit(f"get_auto_quantize_config's config and its solve disagree at {b} bits")
        r.update(target=b, seconds=s, how="get_auto_quantize_config")
        recipes.append(r)

    groups = []
    for name, s in stats.items():
        groups.append(
            {
                "group": name.replace(".quant_recipe", ""),
                "modules": s["module_names"],
                "searched": name in searched,
                "formats": [str(f) for f in s["formats"]],
                "scores": [float(x) for x in s["scores"]],
                "costs": [float(x) for x in s["costs"]],
            }
        )
    record = {
        "model": MODEL,
        "searchable_linears": len([m for n in searched for m in stats[n]["module_names"]]),
        "cost": cost,
        "cost_denominator": total,
        "all_linears": len(linears),
        "groups": len(stats),
        "format": "INT8_DEFAULT_CFG",
        "format_cfg": mtq.INT8_DEFAULT_CFG,
        "method": "gradient",
        "disabled_layers": ["*lm_head*"],
        "num_calib_steps": calib_steps,
        "num_score_steps": score_steps,
        "batch": [calib["batch_size"], calib["seq_len"]],
        "skipped_batches": skip,
        "data": f"quantgate's {calib['source']} calibration rows (the first batches quantgate eval --scheme reads)",
        "versions": {p: md.version(p) for p in ("nvidia-modelopt", "torch", "transformers", "pulp", "numpy", "scipy")},
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "auto_quantize_seconds": search_s,
        "recipes": recipes,
        "group_scores": groups,
    }
    out_path = work / out
    out_path.write_text(json.dumps(record, indent=1, default=str))
    for r in recipes:
        print(
            f"{r['how']:<26} target {r['target']:>5}: {r['effective_bits']:.3f} bits, "
            f"{len(r['unquantized'])} unquantized, {r['seconds']:.2f} s: {' '.join(r['unquantized'])}"
        )
    print(f"wrote {out_path}")


def _layer_order(name: str) -> tuple:
    parts = name.split(".")
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


# ---------------------------------------------------------------------------------------------- measure


def _quantgate(args: list[str], log: Path) -> float:
    env = dict(os.environ)
    extra = os.environ.get("QUANTGATE_PYTHONPATH")
    if extra:
        env["PYTHONPATH"] = extra + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-c", "import sys; from quantgate.cli import main; sys.exit(main())", *args]
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write("$ quantgate " + " ".join(args) + "\n")
        f.flush()
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    s = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"quantgate {' '.join(args)} exited {rc}; see {log}")
    return s


def _run(args: list[str], run: Path, log: Path, collect: bool = False) -> float | None:
    """``quantgate eval ... --out run``, or the one already there (its time from ``seconds.json``); with
    ``collect``, never a new one (None where none is there)."""
    done = run / "seconds.json"
    if done.exists():
        return float(json.loads(done.read_text())["seconds"])
    if collect:
        return None
    s = _quantgate([*args, "--out", str(run)], log)
    done.write_text(json.dumps({"seconds": s}))
    return s


def measure(
    work: Path, out: Path, searches: list[str], limit: int, dtype: str, schemes: list[str], collect: bool = False
) -> None:
    """quantgate's side: float vs each recipe (same documents), the change with its paired 95% interval.
    ``collect``: start no evaluation; write what the runs already in ``work`` hold (the rest as not measured)."""
    import hashlib

    found = {name: json.loads((work / name).read_text()) for name in searches}
    runs, log = work / "runs", work / "measure.log"
    runs.mkdir(exist_ok=True)
    common = ["--tasks", "quantgate_ppl", "--limit", str(limit), "--dtype", dtype]
    float_s = _run(["eval", MODEL, *common], runs / "float", log, collect)
    distinct: dict[tuple, list[dict]] = {(): []}  # no keeps first: the plain scheme
    for name, f in found.items():
        for r in f["recipes"]:
            distinct.setdefault(tuple(r["unquantized"]), []).append({"search": name, **r})
    rows = []
    for scheme in schemes:
        for kept, recipes in distinct.items():
            full = scheme if not kept else f"{scheme}{',' if ':' in scheme else ':'}keep={'|'.join(kept)}"
            name = hashlib.sha1(full.encode()).hexdigest()[:12]
            s = _run(["eval", MODEL, *common, "--scheme", full], runs / name, log, collect)
            cmp_dir = work / "cmp" / name
            found_by = [{k: r[k] for k in ("search", "how", "target", "effective_bits", "seconds")} for r in recipes]
            if s is None or float_s is None:
                rows.append(
                    {"scheme": scheme, "run": name, "kept": list(kept), "found_by": found_by, "measured": False}
                )
                print(f"{len(kept):>3} kept: not measured (--collect) {full[:100]}", flush=True)
                continue
            if not (cmp_dir / "compare.csv").exists():
                _quantgate(["compare", str(runs / name), "--baseline", str(runs / "float"), "--out", str(cmp_dir)], log)
            with (cmp_dir / "compare.csv").open() as f:
                table = list(csv.DictReader(f))
            rows.append(
                {
                    "scheme": scheme,
                    "run": name,
                    "kept": list(kept),
                    "found_by": found_by,
                    "measured": True,
                    "eval_seconds": s,
                    "compare": table,
                }
            )
            q = table[-1]
            print(
                f"{len(kept):>3} kept, {s:5.0f} s: word ppl {float(q['quantgate_ppl/word_perplexity delta']):+.2%} "
                f"[{float(q['quantgate_ppl/word_perplexity delta low']):+.2%}, "
                f"{float(q['quantgate_ppl/word_perplexity delta high']):+.2%}] {full[:100]}",
                flush=True,
            )
    result = {
        "searches": found,
        "measure": {
            "model": MODEL,
            "task": "quantgate_ppl",
            "limit": limit,
            "dtype": dtype,
            "float_eval_seconds": float_s,
            "complete": all(r["measured"] for r in rows),
            "rows": rows,
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("prepare", help="quantgate's Python: float folder and calibration rows")
    a.add_argument("--work", type=Path, required=True)
    a.add_argument("--batches", type=int, default=16)
    b = sub.add_parser("search", help="ModelOpt's venv: auto_quantize, then a re-solve per --bits")
    b.add_argument("--work", type=Path, required=True)
    b.add_argument("--bits", default=",".join(map(str, BITS)))
    b.add_argument("--calib-steps", type=int, default=16)
    b.add_argument("--score-steps", type=int, default=16)
    b.add_argument("--skip", type=int, default=0, help="leave out the first SKIP batches of calib.json")
    b.add_argument("--out", type=Path, default=Path("search.json"), help="file name in --work")
    b.add_argument(
        "--count-head", action="store_true", help="ModelOpt's default accounting: the LM head in the bits at 16"
    )
    c = sub.add_parser("measure", help="quantgate's Python: each recipe's change with its interval")
    c.add_argument("--work", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--search", default="search.json", help="','-separated search files in --work")
    c.add_argument("--limit", type=int, default=18)
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--schemes", default=";".join(SCHEMES), help="';'-separated quantgate schemes")
    c.add_argument("--collect", action="store_true", help="start no evaluation: write what the runs hold")
    args = p.parse_args()
    if args.step == "prepare":
        prepare(args.work, args.batches)
    elif args.step == "search":
        search(
            args.work,
            [float(x) for x in args.bits.split(",")],
            args.calib_steps,
            args.score_steps,
            not args.count_head,
            args.skip,
            args.out,
        )
    else:
        measure(
            args.work,
            args.out,
            args.search.split(","),
            args.limit,
            args.dtype,
            [s for s in args.schemes.split(";") if s],
            args.collect,
        )


if __name__ == "__main__":
    main()
