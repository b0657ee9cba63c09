"""How many held-out documents resolve a perplexity change: the 95% paired interval of the relative change (a
scheme vs float, quantgate_ppl) over the first k documents (taken in turn from each work), for growing k, by the
package's rule (works resampled; approximate below quantgate.stats.MIN_CLUSTERS works: quantgate.stats.interval_method).

    python benchmarks/interval_width.py                          # smollm2-135m, w8a8-int8-dynamic, 24 docs
    python benchmarks/interval_width.py --model tiny-llama --docs 2

Both models are evaluated once over ``--docs`` documents (batch 1: a 4096-token window of SmolLM2's
vocabulary is 0.8 GB of logits per sequence); the prefixes reuse those per-document values.
"""

from __future__ import annotations

import argparse

import quantgate as qg
from quantgate.stats import interval_method, paired_delta

PREFIXES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 89)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--scheme", default="w8a8-int8-dynamic", help="a scheme that needs no calibration")
    ap.add_argument("--docs", type=int, default=24)
    args = ap.parse_args(argv)
    from quantgate.model_files import load_or_build

    model = load_or_build(args.model, None)
    tok = qg.tokenizer(model)
    runs = {
        name: qg.evaluate(m, tok, ["quantgate_ppl"], limit=args.docs, batch_size=1).documents["quantgate_ppl"]
        for name, m in (("float", model), ("quant", qg.quantize(model, args.scheme)))
    }
    print(f"{args.model}, {args.scheme} vs float, quantgate_ppl, 95% paired interval over the first k documents")
    print(
        "| docs | works | tokens | word perplexity change [95% CI] | width (pp) | interval | byte perplexity change "
        "[95% CI] |\n|---|---|---|---|---|---|---|"
    )
    for k in (k for k in PREFIXES if k <= len(runs["float"].ids)):
        first = {name: docs.first(k) for name, docs in runs.items()}
        word, byte = (paired_delta(first["float"], first["quant"], m) for m in ("word_perplexity", "byte_perplexity"))
        width = "-" if word.low is None or word.high is None else f"{100 * (word.high - word.low):.2f}"
        base = first["float"]
        print(
            f"| {k} | {len(set(base.works or ()))} | {sum(base.tokens or ()):,} | {word} | {width} | "
            f"{interval_method(word.clusters or 0)} | {byte} |"
        )


if __name__ == "__main__":
    main()
