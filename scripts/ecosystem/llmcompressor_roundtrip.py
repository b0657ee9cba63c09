#!/usr/bin/env python
"""llm-compressor -> quantgate round trip on SmolLM2-135M.

1. a venv with llmcompressor==0.14.0.1 (it pins transformers <= 5.17 and its own compressed-tensors,
   so it cannot share quantgate's python); torch==2.13.0 first so pip takes the CPU build on this disk;
2. SmolLM2-135M float saved by ``quantgate.save`` (quantgate's python);
3. in the venv: llm-compressor's ``oneshot`` with ``QuantizationModifier(targets="Linear",
   scheme="W8A8", ignore=["lm_head"])`` on calibration texts of quantgate's bundled train split,
   written as a compressed-tensors checkpoint;
4. back in quantgate's python: ``quantgate info``, ``quantgate eval --tasks quantgate_ppl`` of both
   folders and ``quantgate compare FLOAT CT --baseline FLOAT``;
5. results/ecosystem/llmcompressor.md and llmcompressor.json.

Run from the repository root with quantgate's python:

    python scripts/ecosystem/llmcompressor_roundtrip.py            # reuses the venv and folders it finds
    python scripts/ecosystem/llmcompressor_roundtrip.py --help
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _venv import (
    RESULTS,
    Command,
    EcosystemError,
    Recorder,
    corpus_texts,
    dir_size,
    display,
    ensure_venv,
    human_size,
    installed_versions,
    log,
    main_versions,
    quant_method,
    run_in_venv,
    run_main,
    save_float_smollm2,
    script_exit,
    write_json,
)

LLMC = "0.14.0.1"
TORCH = "2.13.0"
METRIC = "quantgate_ppl/word_perplexity"

ONESHOT = r'''
"""Runs in the llm-compressor venv: oneshot W8A8 on a float checkpoint, saved as compressed-tensors."""
import json
import sys
import time


def main():
    inp = json.load(open(sys.argv[1]))
    t0 = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(inp["float_dir"])
    model = AutoModelForCausalLM.from_pretrained(inp["float_dir"], dtype=torch.float32)
    rows = []
    for text in inp["texts"]:
        enc = tok(text, truncation=True, max_length=inp["max_seq_length"])
        rows.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    ds = Dataset.from_list(rows)
    print(f"calibration: {len(rows)} texts, {sum(len(r['input_ids']) for r in rows)} tokens", flush=True)
    recipe = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])
    t1 = time.monotonic()
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        max_seq_length=inp["max_seq_length"],
        num_calibration_samples=len(rows),
    )
    oneshot_s = time.monotonic() - t1
    model.save_pretrained(inp["out_dir"], save_compressed=True)
    tok.save_pretrained(inp["out_dir"])
    config = json.load(open(f"{inp['out_dir']}/config.json"))
    from importlib import metadata

    versions = {d: metadata.version(d) for d in ("llmcompressor", "compressed-tensors", "transformers", "torch")}
    json.dump(
        {
            "oneshot_s": oneshot_s,
            "total_s": time.monotonic() - t0,
            "calibration_tokens": sum(len(r["input_ids"]) for r in rows),
            "quantization_config": config.get("quantization_config"),
            "versions": versions,
        },
        open(sys.argv[2], "w"),
    )


if __name__ == "__main__":
    main()
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Quantize SmolLM2-135M with llm-compressor (W8A8, compressed-tensors) in its own venv, then "
        "read, evaluate and compare the checkpoint with quantgate; writes results/ecosystem/llmcompressor.{md,json}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--venv", type=Path, default=Path("/tmp/qg-venvs/llmcompressor"), help="llm-compressor's venv")
    p.add_argument("--recreate-venv", action="store_true", help="delete the venv and install it again")
    p.add_argument("--work", type=Path, default=Path("/tmp/qg-ecosystem"), help="checkpoints and eval runs go here")
    p.add_argument("--force", action="store_true", help="redo the checkpoints and evaluations even if present")
    p.add_argument("--calib-texts", type=int, default=32, help="calibration texts from the bundled train split")
    p.add_argument("--max-seq-length", type=int, default=512, help="tokens kept of each calibration text")
    p.add_argument("--limit", type=int, default=24, help="quantgate_ppl documents (of the bundled test split)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where llmcompressor.md and .json go")
    p.add_argument("--setup-only", action="store_true", help="only create the venv")
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite llmcompressor.md from the llmcompressor.json in --out"
    )
    return p.parse_args(argv)


def info_quantization(command: Command) -> str | None:
    """The ``quantization`` row of ``quantgate info``'s output."""
    m = re.search(r"^quantization\s+(.+)$", command.tail, re.M)
    return m.group(1).strip() if m else None


def eval_run(model_dir: Path, run: Path, limit: int, force: bool, rec: Recorder) -> tuple[dict, dict]:
    """``quantgate eval`` (or its eval.json from an earlier run with the same settings); returns the eval
    and how it was made (command, seconds, date; ``reused``)."""
    out, meta = run / "eval.json", run / "made-by.json"
    if out.is_file() and not force:
        data = json.loads(out.read_text())
        if data["settings"].get("limit") == limit and data["settings"].get("model") in (str(model_dir), None):
            log(f"reusing {out}")
            made = json.loads(meta.read_text()) if meta.is_file() else {}
            return data, {**made, "reused": True}
    args = ["eval", str(model_dir), "--tasks", "quantgate_ppl", "--limit", str(limit), "--out", str(run)]
    cmd = run_main(args, recorder=rec, note=f"evaluate {model_dir.name}")
    made = {"command": display(cmd.argv), "wall_s": cmd.wall_s, "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    meta.write_text(json.dumps(made, indent=2))
    return json.loads(out.read_text()), {**made, "reused": False}


def compare_runs(float_run: Path, ct_run: Path, out: Path, rec: Recorder) -> dict:
    """``quantgate compare FLOAT CT --baseline FLOAT``; where that flag is missing, what happened and the
    plain ``quantgate compare FLOAT CT``. Returns what compare gave for the CT run's word perplexity."""
    wanted = ["compare", str(float_run), str(ct_run), "--baseline", str(float_run), "--out", str(out)]
    first = run_main(wanted, recorder=rec, note="compare with --baseline", check=False)
    result: dict = {"command": display(first.argv), "rc": first.rc, "baseline_flag": first.rc == 0}
    if first.rc != 0:
        result["error"] = first.tail.strip().splitlines()[-1] if first.tail.strip() else f"exit {first.rc}"
        log(f"compare --baseline failed: {result['error']}; running compare without it")
        plain = ["compare", str(float_run), str(ct_run), "--out", str(out)]
        second = run_main(plain, recorder=rec, note="compare without --baseline (the flag is missing)", check=False)
        result["fallback_command"] = display(second.argv)
        result["fallback_rc"] = second.rc
        if second.rc != 0:
            result["fallback_error"] = second.tail.strip().splitlines()[-1] if second.tail.strip() else ""
            return result
    result["table"] = (out / "compare.md").read_text() if (out / "compare.md").is_file() else None
    rows = (
        list(csv.DictReader((out / "compare.csv").read_text().splitlines())) if (out / "compare.csv").is_file() else []
    )
    result["rows"] = rows
    delta = [r for r in rows if r.get(f"{METRIC} delta") not in (None, "")]
    if delta:
        r = delta[0]
        result["delta"] = {
            "value": float(r[f"{METRIC} delta"]),
            "low": float(r[f"{METRIC} delta low"]) if r.get(f"{METRIC} delta low") else None,
            "high": float(r[f"{METRIC} delta high"]) if r.get(f"{METRIC} delta high") else None,
            "scheme": r.get("scheme"),
        }
    return result


def script_delta(float_eval: dict, ct_eval: dict) -> dict:
    """quantgate's own paired bootstrap (quantgate.stats.paired_delta) on the two eval.json files: what
    compare --baseline computes, for the case where compare could not pair the runs itself."""
    from quantgate.stats import paired_delta

    d = paired_delta(float_eval["documents"]["quantgate_ppl"], ct_eval["documents"]["quantgate_ppl"], "word_perplexity")
    return {"value": d.value, "low": d.low, "high": d.high, "method": d.method}


def pct(d: dict | None) -> str:
    if not d:
        return "-"
    iv = "" if d.get("low") is None else f" [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]"
    return f"{100 * d['value']:+.2f}%{iv}"


def write_report(data: dict, out: Path) -> None:
    rows = data["checkpoints"]
    cmp = data["compare"]
    lines = [
        "# llm-compressor -> quantgate round trip (SmolLM2-135M, W8A8)",
        "",
        f"Generated by `{data['regenerate']}` on {data['date']} ({data['machine']}). "
        f"Total wall time {data['wall_s']['total']:.0f} s.",
        "",
        'llm-compressor\'s `oneshot` with `QuantizationModifier(targets="Linear", scheme="W8A8", '
        f'ignore=["lm_head"])` ({data["calibration"]["texts"]} calibration texts of quantgate\'s bundled train '
        f"split, at most {data['calibration']['max_seq_length']} tokens each, "
        f"{data['calibration']['tokens']:,} tokens) quantized SmolLM2-135M saved by `quantgate.save`; quantgate read "
        "the compressed-tensors checkpoint it wrote, and evaluated both folders on "
        f"`quantgate_ppl` (the first {data['limit']} documents of the bundled test split).",
        "",
    ]
    if data["oneshot"].get("pipeline") == "DataFreePipeline":
        lines += [
            "llm-compressor inferred its `DataFreePipeline` for this recipe: W8A8's activation scales are dynamic "
            "(per token, at run time) and its weight scales are the min-max of each output channel, so the "
            "calibration texts were handed to `oneshot` but no forward pass ran over them.",
            "",
        ]
    lines += [
        "| checkpoint | size on disk | scheme (quantgate info) | word perplexity | delta vs float [95% interval] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        delta = "(baseline)" if r["name"] == "float" else pct(r.get("delta"))
        lines.append(
            f"| {r['name']} (`{r['path']}`) | {human_size(r['size_bytes'])} | {r['quantization'] or '-'} | "
            f"{r['word_perplexity']:.4f} | {delta} |"
        )
    ct = rows[-1]
    lines += ["", f"Delta source: {ct.get('delta_source', '-')}."]
    if not cmp.get("baseline_flag"):
        lines += [
            "",
            f"`{cmp['command']}` exited {cmp['rc']}: `{cmp.get('error', '')}`. The script then ran "
            f"`{cmp.get('fallback_command', '-')}` (exit {cmp.get('fallback_rc', '-')}), which pairs runs by model "
            "name and so finds no float run for the compressed-tensors folder; the delta above is quantgate's "
            "`quantgate.stats.paired_delta` (the paired bootstrap compare uses) on the two eval.json files. The "
            "script keeps the `--baseline` command, so a rerun uses it once the flag exists.",
        ]
    if cmp.get("table"):
        lines += ["", "`quantgate compare` printed:", "", cmp["table"].strip()]
    lines += [
        "",
        f"`quantgate info` of the compressed-tensors folder says `quantization  {ct['quantization']}`; its "
        f"config.json has `quant_method: {ct['quant_method']}`"
        + (f", format `{ct['ct_format']}`" if ct.get("ct_format") else "")
        + ".",
        "",
        "## Versions",
        "",
        "| where | package | version |",
        "| --- | --- | --- |",
    ]
    for where, vs in data["versions"].items():
        for k, v in vs.items():
            lines.append(f"| {where} | {k} | {v} |")
    lines += [
        "",
        "## Wall time",
        "",
        "| step | seconds |",
        "| --- | --- |",
    ]
    for k, v in data["wall_s"].items():
        lines.append(f"| {k} | {v:.1f} |")
    lines += ["", "## Commands (in order)", ""]
    earlier = data.get("reused_from_earlier_runs") or {}
    if earlier:
        lines += ["Made by an earlier run of the script and reused by this one:", "", "```"]
        for c in (earlier.get("venv") or {}).get("commands", []):
            where = "" if c["where"] == "main" else f"[venv {c['where']}] "
            lines.append(f"{where}{c['display']}    # exit {c['rc']}, {c['wall_s']:.1f} s")
        for key in ("eval float", "eval llm-compressor W8A8"):
            if earlier.get(key):
                x = earlier[key]
                lines.append(f"{x.get('command', '(no record kept)')}    # {x.get('wall_s', 0):.1f} s")
        if earlier.get("oneshot"):
            o = earlier["oneshot"]
            lines.append(
                f"[venv {data['venv']}] {o.get('command', '(oneshot snippet)')}    # {o.get('process_s', 0):.1f} s"
            )
        lines += ["```", "", "This run:", ""]
    lines += ["```"]
    for c in data["commands"]:
        where = "" if c["where"] == "main" else f"[venv {c['where']}] "
        note = f" ({c['note']})" if c.get("note") else ""
        lines.append(f"{where}{c['display']}    # exit {c['rc']}, {c['wall_s']:.1f} s{note}")
    lines += [
        "```",
        "",
        "The oneshot step runs a file written by the script (the `ONESHOT` snippet in "
        "`scripts/ecosystem/llmcompressor_roundtrip.py`) with HF_HUB_OFFLINE=1; nothing is downloaded.",
        "",
        "## Regenerate",
        "",
        "```",
        data["regenerate"],
        "```",
        "",
        f"It creates the venv ({data['venv']}) if missing (pip: `torch=={TORCH}`, then `llmcompressor=={LLMC}`), "
        f"reuses the checkpoints and eval runs under {data['work']} (`--force` redoes them), and rewrites this "
        "file and llmcompressor.json.",
        "",
    ]
    (out / "llmcompressor.md").write_text("\n".join(lines))
    log(f"wrote {out / 'llmcompressor.md'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        write_report(json.loads((args.out / "llmcompressor.json").read_text()), args.out)
        return 0
    t_start = time.monotonic()
    rec = Recorder()
    wall: dict[str, float] = {}
    pins = {"llmcompressor": LLMC, "torch": TORCH}
    t = time.monotonic()
    venv_state = ensure_venv(
        args.venv,
        pins,
        [[f"torch=={TORCH}"], [f"llmcompressor=={LLMC}"]],
        recreate=args.recreate_venv,
        recorder=rec,
    )
    earlier: dict[str, dict | None] = {}  # what was made by an earlier run and reused now
    if venv_state["reused"]:
        earlier["venv"] = venv_state["setup"]
        setup_s = (venv_state["setup"] or {}).get("wall_s")
        wall["venv (reused; made earlier in the seconds shown)" if setup_s else "venv (reused)"] = setup_s or 0.0
    else:
        wall["venv (created)"] = time.monotonic() - t
    venv_versions = installed_versions(args.venv, ["llmcompressor", "compressed-tensors", "transformers", "torch"])
    log(f"venv versions: {venv_versions}")
    if args.setup_only:
        return 0

    work = args.work
    float_dir, ct_dir = work / "smollm2-float", work / "smollm2-llmcompressor-w8a8"
    t = time.monotonic()
    fresh_float = args.force or not (float_dir / "config.json").is_file()
    save_float_smollm2(float_dir, recorder=rec, force=args.force)
    wall["save float (quantgate)" + ("" if fresh_float else ", reused")] = time.monotonic() - t

    t = time.monotonic()
    oneshot: dict
    meta = work / "meta" / "llmcompressor-oneshot.json"
    if quant_method(ct_dir) == "compressed-tensors" and meta.is_file() and not args.force:
        log(f"reusing the llm-compressor checkpoint {ct_dir} (made {json.loads(meta.read_text()).get('date')})")
        oneshot = json.loads(meta.read_text())
        earlier["oneshot"] = oneshot
        wall["llm-compressor oneshot process (reused; made earlier in the seconds shown)"] = oneshot.get("process_s", 0)
    else:
        texts = corpus_texts("train", args.calib_texts)
        payload = {
            "float_dir": str(float_dir),
            "out_dir": str(ct_dir),
            "texts": [t["text"] for t in texts],
            "max_seq_length": args.max_seq_length,
        }
        if ct_dir.exists():
            shutil.rmtree(ct_dir)
        result, cmd = run_in_venv(args.venv, ONESHOT, payload, name="oneshot", recorder=rec, timeout=3600)
        oneshot = dict(result or {})
        oneshot.update(
            calibration_ids=[t["id"] for t in texts],
            date=time.strftime("%Y-%m-%d %H:%M %Z"),
            process_s=cmd.wall_s,
            command=display(cmd.argv),
            pipeline=next((m.group(1) for m in [re.search(r"Inferred `(\w+)`", cmd.output)] if m), None),
        )
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(oneshot, indent=2))
        wall["llm-compressor oneshot process (in the venv, incl. imports, load and save)"] = time.monotonic() - t
    if quant_method(ct_dir) != "compressed-tensors":
        raise EcosystemError(f"{ct_dir}/config.json has no quantization_config with quant_method compressed-tensors")

    t = time.monotonic()
    infos = {
        name: run_main(["info", str(d)], recorder=rec, note=f"info {name}", check=False)
        for name, d in (("float", float_dir), ("llmcompressor-w8a8", ct_dir))
    }
    wall["quantgate info (both)"] = time.monotonic() - t
    for name, c in infos.items():
        if c.rc != 0:
            raise EcosystemError(f"quantgate info of {name} failed (exit {c.rc}):\n{c.tail}")

    runs = work / "runs"
    t = time.monotonic()
    float_eval, made = eval_run(float_dir, runs / "float", args.limit, args.force, rec)
    wall["quantgate eval float" + (" (reused; made earlier in the seconds shown)" if made["reused"] else "")] = (
        made.get("wall_s", 0.0) if made["reused"] else time.monotonic() - t
    )
    if made["reused"]:
        earlier["eval float"] = made
    t = time.monotonic()
    ct_eval, made = eval_run(ct_dir, runs / "llmcompressor-w8a8", args.limit, args.force, rec)
    wall[
        "quantgate eval llm-compressor W8A8"
        + (" (reused; made earlier in the seconds shown)" if made["reused"] else "")
    ] = made.get("wall_s", 0.0) if made["reused"] else time.monotonic() - t
    if made["reused"]:
        earlier["eval llm-compressor W8A8"] = made

    t = time.monotonic()
    cmp = compare_runs(runs / "float", runs / "llmcompressor-w8a8", runs / "compare", rec)
    wall["quantgate compare"] = time.monotonic() - t
    own = script_delta(float_eval, ct_eval)
    if cmp.get("delta"):
        delta, source = cmp["delta"], "`quantgate compare --baseline` (compare.csv)"
    else:
        delta, source = own, f"`quantgate.stats.paired_delta` on the two eval.json files ({own['method']})"

    qc = oneshot.get("quantization_config") or {}
    checkpoints = []
    for name, d, ev in (("float", float_dir, float_eval), ("llmcompressor-w8a8", ct_dir, ct_eval)):
        checkpoints.append(
            {
                "name": name,
                "path": str(d),
                "size_bytes": dir_size(d),
                "quantization": info_quantization(infos[name]),
                "quant_method": quant_method(d),
                "ct_format": qc.get("format") if name != "float" else None,
                "word_perplexity": ev["results"]["quantgate_ppl"]["word_perplexity"],
                "byte_perplexity": ev["results"]["quantgate_ppl"].get("byte_perplexity"),
                "eval_settings": ev["settings"],
            }
        )
    checkpoints[-1]["delta"] = delta
    checkpoints[-1]["delta_source"] = source
    checkpoints[-1]["delta_paired_bootstrap_by_script"] = own
    wall["total"] = time.monotonic() - t_start
    regenerate = "python scripts/ecosystem/llmcompressor_roundtrip.py" + (
        "" if argv is None and sys.argv[1:] == [] else " " + shlex.join(sys.argv[1:] if argv is None else argv)
    )
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.system()} {platform.machine()}, {__import__('os').cpu_count()} CPUs, no GPU",
        "regenerate": regenerate,
        "venv": str(args.venv),
        "work": str(work),
        "limit": args.limit,
        "calibration": {
            "texts": args.calib_texts,
            "max_seq_length": args.max_seq_length,
            "tokens": oneshot.get("calibration_tokens"),
            "split": "train",
            "ids": oneshot.get("calibration_ids"),
        },
        "oneshot": {
            k: oneshot.get(k)
            for k in ("oneshot_s", "total_s", "process_s", "date", "pipeline", "command", "quantization_config")
        },
        "reused_from_earlier_runs": earlier,
        "checkpoints": checkpoints,
        "compare": cmp,
        "info_output": {k: c.tail for k, c in infos.items()},
        "versions": {
            f"venv {args.venv}": venv_versions,
            "quantgate's python": {
                **main_versions(["quantgate", "torch", "transformers", "compressed-tensors", "lm_eval"]),
                "python": platform.python_version(),
            },
        },
        "wall_s": wall,
        "commands": [{**c, "display": display(c["argv"])} for c in rec.as_json()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "llmcompressor.json", data)
    write_report(data, args.out)
    log(
        f"float word ppl {checkpoints[0]['word_perplexity']:.4f}; llm-compressor W8A8 "
        f"{checkpoints[1]['word_perplexity']:.4f} ({pct(delta)}); quantgate info: {checkpoints[1]['quantization']}"
    )
    return 0


if __name__ == "__main__":
    script_exit(main)
