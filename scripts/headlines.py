"""Regenerate the headline numbers of docs/findings.md (its last table) from the committed results, and check
every number README.md and docs/ quote from them.

    python scripts/headlines.py           # rewrite the generated blocks in place
    python scripts/headlines.py --check   # exit 1 if the page differs from what this would write, or a quoted
                                          # number is not in the results page its paragraph cites

A paragraph (or table, or list) of README.md or a docs page (docs/reference/ is generated from the code) that
cites a committed results page (``results/<study>/report.md``, a ``results/bench`` page, ...) may quote only
what those pages hold: each interval (``[+9.8, +14.9]``) verbatim, and each other decimal number; an interval its
source marks approximate keeps the mark, and no verdict ("within noise", "fixed", "no difference larger than", ...)
is read off it in the same sentence. A paragraph that cites no results page may quote only intervals that some
committed results file (or the headline table below, written from them) holds, and decimals of three places or
more (outside code) that a results page holds.

Each headline sits between ``<!-- headlines:NAME -->`` and ``<!-- /headlines -->`` and is written by
the function NAME below from results/ (metrics.json; for cpu_recipe_search the search's summary.json
files) or, for the study not run here, from its study file. A quantization change carries its 95%
interval (``+12.3% [+9.8, +14.9]``, :mod:`quantgate.stats`): over documents where the metrics hold
per-document values, across seeds where a study trained several; where neither exists the headline
says the interval is unavailable (``[n/a]``) rather than invent one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from quantgate import experiment as ex
from quantgate.models.presets import preset_config
from quantgate.stats import Delta, format_delta, seed_delta, share_removed, spearman
from quantgate.study import CellRecord, StudyRecord, load_study, read_metrics
from quantgate.study.fixes import Verdict, fix_rows
from quantgate.study.measures import (
    BUDGET,
    bit_sweeps,
    budget,
    change_gap,
    float_change,
    max_layer_sink,
    peak_activation,
    ppl_change,
    ppl_of,
    scheme_change,
)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "findings.md"  # the headline table moves with the findings
BLOCK = re.compile(r"(<!-- headlines:(\w+) -->)(.*?)(<!-- /headlines -->)", re.S)
NO_DOCUMENTS = "intervals n/a: the committed metrics hold no per-document values"
SINK_TARGET, RATIO_TARGET = 0.3, 50  # the CPU recipe search's targets (results/cpu_recipe/search.md)
BONDARENKO = "w8a8-int8-bondarenko"
SCHEMES = {
    BONDARENKO: "W8A8 at Bondarenko's sites",
    "w8a8-int8-static": "static W8A8 (Linear inputs)",
    "w8a8-int8-dynamic": "dynamic INT8",
    "w8a8-fp8-e4m3": "FP8",
    "llm-int8": "LLM.int8",
    "torchao-int8-dynamic": "torchao INT8",
}
KURTOSIS = "kurtosis (Bondarenko et al.'s tensors)"
T = TypeVar("T")


def _metrics(name: str) -> dict:
    """An experiment script's metrics.json."""
    return json.loads((ROOT / "results" / name / "metrics.json").read_text())


def _study(name: str) -> StudyRecord:
    """A study run's metrics.json."""
    return read_metrics(ROOT / "results" / name)


def _cells(name: str) -> dict[str, CellRecord]:
    return {c.id: c for c in _study(name).cells}


def _num(x: float, digits: int = 3) -> str:
    """``digits`` significant digits; whole numbers with thousands separators from 10 ** digits on."""
    return f"{x:,.0f}" if abs(x) >= 10**digits else f"{x:.{digits}g}"


def _fixed(decimals: int):
    """A formatter with ``decimals`` decimal places."""
    return lambda x: f"{x:.{decimals}f}"


def _ratio(x: float) -> str:
    """A max / median ratio, two significant digits."""
    return _num(x, 2)


def _pct(x: float) -> str:
    return f"{x:+.2f}%" if abs(x) < 10 else f"{x:+.0f}%"


def _span(values, fmt=_num, sep: str = "-") -> str:
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def _known(x: T | None) -> T:
    """A value the headline cannot do without (a change, a measure, a match): None is an error in the results."""
    assert x is not None, "a value the headline needs is missing"
    return x


def _change(cell: CellRecord, scheme: str) -> Delta | None:
    """The perplexity change that ``scheme`` causes in ``cell``, with its interval where there is one."""
    return ppl_change(cell, scheme)


def _delta(d: Delta | None) -> str:
    return format_delta(d, noise=", within noise")


def _changes(deltas: Sequence[Delta | None]) -> str:
    """The span of several changes (%)."""
    return _span([100 * _known(d).value for d in deltas], _pct, " to ")


def _share(ungated: float, gated: float) -> str:
    """The share of the ungated model's perplexity change that the gated one does not have (1 - gated / ungated;
    negative: it adds to the damage), from the two changes themselves, whichever form their difference takes."""
    share = share_removed(ungated, gated)
    if share is None:
        return ""
    return f", {share:.0%} of the ungated damage removed" if share >= 0 else f", {-share:.0%} added to it"


def _across(gaps: list[Delta]) -> str:
    """What several seeds' paired differences say together: the direction where every seed's decisive interval
    agrees on it (the seeds taken as independent replicates, nothing assumed about their sizes), else that no
    direction holds; beside it their mean with a t-interval across the seeds, which with a few unlike seeds
    measures how much their sizes differ and is no test of the sign (so it carries no "within noise")."""
    k = len(gaps)
    below = sum(g.decisive and _known(g.high) < 0 for g in gaps)
    above = sum(g.decisive and _known(g.low) > 0 for g in gaps)
    if below == k:
        sign = f"below 0 in all {k} seeds: the gated twin loses less in every seed"
    elif above == k:
        sign = f"above 0 in all {k} seeds: the gated twin loses more in every seed"
    else:
        sign = (
            f"below 0 in {below}, above 0 in {above}, neither in {k - below - above} of {k} seeds: no direction holds"
        )
    if any(g.kind != "points" for g in gaps):  # a difference of ratios beside one of points: no common scale
        return f"{sign} (no mean across the seeds: some differences are ratios of perplexity ratios)"
    mean = seed_delta([g.value for g in gaps], "points")
    return f"{sign} (mean {format_delta(mean, noise='')} across the seeds: their sizes differ, not a test of the sign)"


def _noise(deltas: Sequence[Delta | None]) -> str:
    """What the intervals of ``deltas`` say: how many exclude 0, or that there are none."""
    known = [d for d in map(_known, deltas) if d.low is not None]
    if not known:
        return NO_DOCUMENTS
    missing = f", {len(deltas) - len(known)} without one" if len(known) < len(deltas) else ""
    return f"{sum(not d.within_noise for d in known)} of {len(known)} intervals exclude 0{missing}"


def _peaks(cells, fmt) -> str:
    """The span of the cells' largest residual activations, and of the max / median of their blocks."""
    pairs = [peak_activation(c) for c in cells]
    return f"{_span([p for p, _ in pairs], fmt)}, max/median {_span([r for _, r in pairs], _ratio)}"


def _steps_tokens(cells) -> str:
    ((steps, tokens),) = {(c.trained.steps, c.trained.tokens) for c in cells}
    return f"{steps} steps ({tokens / 1e6:.1f} M tokens)"


def quickstart() -> str:
    metrics = _study("quickstart")
    cells = {c.id: c for c in metrics.cells}
    smol = cells["smollm2-135m/vanilla"]
    fp, static = _known(ppl_of(smol.float_results)), _known(ppl_of(smol.schemes["w8a8-int8-static"].results))
    others = ", ".join(
        f"{label} {_delta(_change(smol, s))}"
        for s, label in SCHEMES.items()
        if s in smol.schemes and s != "w8a8-int8-static"
    )
    ((ungated, gated),) = metrics.report.pairs
    u, g = (next(c for c in cells.values() if c.model == name) for name in (ungated, gated))
    ((_, widths),) = bit_sweeps(metrics.schemes).items()
    found = [budget([(b, _change(c, s)) for b, s in widths]) for c in (u, g)]
    narrower = "; ".join(f"A{b} {_delta(_change(u, s))} vs {_delta(_change(g, s))}" for b, s in widths[1:3])
    return (
        f"twins (sink {max_layer_sink(u)[0]:.2f} ungated vs {max_layer_sink(g)[0]:.2f} gated): W8A8 at "
        f"Bondarenko's sites {_delta(_change(u, BONDARENKO))} ungated vs {_delta(_change(g, BONDARENKO))} "
        f"gated, activation-bit budget (+{BUDGET:.0%}) "
        + " vs ".join(f"A{f[0]}" if f else "none" for f in found)
        + f"; {narrower}; static W8A8 (Linear inputs) takes SmolLM2's perplexity {_num(fp)} -> {_num(static)} "
        f"({_delta(_change(smol, 'w8a8-int8-static'))}); {others}"
    )


def bondarenko_table2() -> str:
    cells = list(_cells("bondarenko_table2").values())
    paper = [_change(c, s) for c in cells for s in c.schemes if s == BONDARENKO]
    rest = [_change(c, s) for c in cells for s in c.schemes if s != BONDARENKO]
    return (
        f"{_steps_tokens(cells)} grow no outliers: max inf-norm "
        f"{_span([c.summary.max_inf_norm for c in cells], _fixed(1))}, largest residual activation "
        f"{_peaks(cells, _fixed(1))}, {KURTOSIS} {_span([c.summary.kurtosis for c in cells], _fixed(1))}; "
        f"W8A8 at the paper's sites changes {_changes(paper)} ({_noise(paper)}), static and dynamic INT8 at the "
        f"Linear inputs {_changes(rest)} ({_noise(rest)}); far from the paper's BERT-base outliers: the pipeline "
        "and definitions, not the effect"
    )


def bondarenko_table2_paper() -> str:
    study = load_study(ROOT / "experiments" / "bondarenko_table2_paper.yaml")
    tokens = []
    for m in study.models:
        c = _known(m.train).value
        tokens.append(f"{c.steps * c.batch_size * c.grad_accum * c.seq_len / 1e9:.1f} B tokens per {m.name} run")
    return f"validated by `--dry-run` in CI: {len(study.cells())} cells, {' and '.join(tokens)}"


def _sink(c: CellRecord) -> float:
    """A cell's largest per-layer first-token attention."""
    return max_layer_sink(c)[0]


def qiu_table4() -> str:
    cells = list(_cells("qiu_table4").values())
    plain = next(c for c in cells if c.variant == "vanilla")
    gated = [c for c in cells if c.summary.gate_mean is not None]
    ns = [c.summary.gate_mean for c in gated if c.variant == "g1-ns-sigmoid"]
    rho = spearman([_known(c.summary.gate_mean) for c in gated], [_known(c.summary.sink_mass) for c in gated])
    ((_, a6),) = [(b, s) for b, s in bit_sweeps(_study("qiu_table4").schemes)[BONDARENKO] if b == 6]
    sink, layer = max_layer_sink(plain)
    paper = [_change(c, BONDARENKO) for c in gated]
    narrow = [_change(c, a6) for c in gated]
    return (
        f"{_steps_tokens(cells)} of backcopy: the ungated model grows a first-token sink of {sink:.2f} (layer "
        f"{layer}) and max {_peaks([plain], _fixed(1))}; the gated rows' first-token attention spans "
        f"{_span([_sink(c) for c in gated], _fixed(2))} (max layer), with max {_peaks(gated, _fixed(1))}; mean "
        f"gates {_span([c.summary.gate_mean for c in gated if c.variant != 'g1-ns-sigmoid'], _fixed(2))}"
        f" (NS-sigmoid {_span(ns, _fixed(2))}); W8A8 at Bondarenko's sites: ungated "
        f"{_delta(_change(plain, BONDARENKO))}, gated {_changes(paper)} ({_noise(paper)}); at A6 ungated "
        f"{_delta(_change(plain, a6))}, gated {_changes(narrow)} ({_noise(narrow)}); gate mean vs sink mass "
        f"Spearman {rho:.2f} (n={len(gated)}; the paper's rows: 1.0)"
    )


def hyga_ablation() -> str:
    cells = _cells("hyga_ablation")
    g1 = cells["gqa/g1-elementwise"]
    low = sorted(
        (c for c in cells.values() if c.model == "gqa" and "low_rank" in c.variant),
        key=lambda c: _known(c.cost).gate_params,
    )

    def trio(model: str, fmt) -> str:
        return " -> ".join(fmt(cells[f"{model}/{v}"]) for v in ("vanilla", "g1-elementwise", "hyga"))

    def activation(c):
        peak, ratio = peak_activation(c)
        return f"{_num(_known(peak))} (max/median {_ratio(_known(ratio))})"

    def sink(c):
        return f"{_sink(c):.2f}"

    def rank(c) -> str:
        r = _known(re.search(r"low_rank=(\d+)", c.variant)).group(1)
        share = _known(c.cost).gate_params / _known(g1.cost).gate_params
        return f"d_int {r} ({share:.2f}x G1's gate parameters) {_delta(float_change(g1, c))}"

    paper = [_change(c, BONDARENKO) for c in cells.values()]
    width = preset_config(g1.source["preset"], g1.source["config"]).hidden_size
    return (
        f"{_steps_tokens(cells.values())} of backcopy, d={width}: "
        f"first-token attention vanilla -> G1 -> HyGA {trio('gqa', sink)} (GQA), {trio('mla', sink)} (MLA); max "
        f"activation {trio('gqa', activation)} (GQA); float perplexity against G1, HyGA without the C-gate at "
        + ", ".join(rank(c) for c in low)
        + f", full HyGA {_delta(float_change(g1, cells['gqa/hyga']))}; W8A8 at Bondarenko's sites changes "
        f"{_changes(paper)} ({_noise(paper)})"
    )


def sink_leak_toy() -> str:
    m = _metrics("sink_leak_toy")
    attn, gap, top = m["first_token_attention"], m["implied_gap"], m["top_layers"]
    first, lo, hi = min(attn, key=int), "512", max(attn, key=int)  # lo: past the short-context noise
    keys = " / ".join(f"{int(n) // 1024}k" if int(n) < 1 << 20 else "1M" for n in m["toy"]["leak"])
    held = [attn[n][i] for n in attn if int(lo) <= int(n) for i in top]
    return (
        f"toy (fixed gap {m['toy']['gap']:.2f} nats): leak "
        + " / ".join(f"{v:.4f}" for v in m["toy"]["leak"].values())
        + f" at {keys} keys, the seed's values to their printed digits (it rounds the last up); "
        f"SmolLM2's {len(top)} most sink-heavy layers keep {_span(held, _fixed(2))} of the attention on "
        f"token 0 from {lo} to {hi} keys, while their implied gap grows "
        f"{_span([gap[hi][i] - gap[lo][i] for i in top], _fixed(1))} nats over that range "
        f"({_span([gap[hi][i] - gap[first][i] for i in top], _fixed(1))} from {first} keys) instead of "
        "staying fixed"
    )


def kv_eviction() -> str:
    m = _metrics("kv_eviction")
    smol, plain, gated = m["smollm2-135m"], m["twin-vanilla"], m["twin-g1"]

    def cost(r, w) -> Delta:
        """ppl(w/0) / ppl(w/4) - 1, paired over the sequences."""
        return ex.ppl_change(r["nll"][f"{w}/4"], r["nll"][f"{w}/0"], r["tokens_per_sequence"])

    def ratio(r, w) -> str:
        return ex.format_ratio(cost(r, w), noise=", within noise")

    sink, layer = max((s, i) for i, s in enumerate(plain["first_token_attention"]))
    w = smol["windows"][0]
    twin = [cost(gated, v) for v in gated["windows"]]
    return (
        f"window {w} on SmolLM2: ppl {_num(smol['ppl'][f'{w}/0'])} without the first 4 tokens vs "
        f"{_num(smol['ppl'][f'{w}/4'])} with them ({ratio(smol, w)}; full {_num(smol['ppl']['full'])}); tiny "
        f"ungated (sink {sink:.2f} in layer {layer}): {ratio(plain, plain['windows'][0])} at window "
        f"{plain['windows'][0]}; its G1-gated twin: {ratio(gated, gated['windows'][0])} there, "
        f"{_span([1 + d.value for d in twin], _fixed(2))}x at every window from {gated['windows'][0]} to "
        f"{gated['windows'][-1]} ({_noise(twin).replace('exclude 0', 'exclude 1')})"
    )


def context_extension() -> str:
    m = _metrics("context_extension")
    plain, gated = m["results"]["vanilla"], m["results"]["g1-elementwise"]
    n = m["trained_len"]
    long = max(r["length"] for r in plain.values())
    sink = plain[f"{n}/default"]["first_token_attention_last_quarter"]
    layer = sink.index(max(sink))

    def gate_change(key: str) -> str:
        """G1's perplexity relative to the ungated model's on the same sequences, paired."""
        a, b = plain[key], gated[key]
        return _delta(ex.ppl_change(a["nll"], b["nll"], a["length"] - 1))

    return (
        f"at {long // n}x the training length ({long} tokens), YaRN: ungated {plain[f'{n}/default']['ppl']:.2f} -> "
        f"{plain[f'{long}/yarn']['ppl']:.2f} ppl, G1 {gated[f'{n}/default']['ppl']:.2f} -> "
        f"{gated[f'{long}/yarn']['ppl']:.2f} (G1 vs ungated {gate_change(f'{long}/yarn')}); unscaled RoPE: "
        f"{plain[f'{long}/default']['ppl']:.2f} vs {gated[f'{long}/default']['ppl']:.2f} "
        f"({gate_change(f'{long}/default')}), and the ungated sink collapses ({sink[layer]:.2f} -> "
        f"{plain[f'{long}/default']['first_token_attention_last_quarter'][layer]:.2f} in its sink layer)"
    )


def massive_activation_intervention() -> str:
    m = _metrics("massive_activation_intervention")
    found, r = m["massive"], m["results"]

    def ppl(label, digits=3):
        return _num(r[label]["ppl"], digits)

    def change_of(label) -> Delta:
        """The change from the original, paired over the test sequences."""
        return ex.ppl_change(r["original"]["nll"], r[label]["nll"], m["tokens_per_sequence"])

    zero = r["zero"]["ppl"]
    return (
        f"SmolLM2 massive activations (channels {', '.join(map(str, found['channels']))} at token "
        f"{', '.join(map(str, found['positions']))}, from block {found['layer']}, up to {_num(found['max_abs'])}): "
        f"zero -> ppl {ppl('original', 4)} to {zero / 1e6:.1f} M "
        f"({ex.format_ratio(change_of('zero'), noise=', within noise')}); mean -> {ppl('mean', 4)} "
        f"({_delta(change_of('mean'))}); zeroing {len(found['channels'])} ordinary channels "
        f"{_delta(change_of('zero, random channels (control)'))}"
    )


def cpu_recipe_search() -> str:
    runs = {
        s["name"]: s
        for s in (
            json.loads(p.read_text()) for p in sorted((ROOT / "results/cpu_recipe/search").glob("*/summary.json"))
        )
    }

    def setup(s):
        st = s["settings"]
        return f"{s['preset']} {st.get('schedule', 'cosine')} lr {st['lr']:g}"

    grew = max(runs.values(), key=lambda s: s["max_median_ratio"])
    rest = [s for s in runs.values() if s is not grew]
    return (
        f"{setup(grew)} grows outliers (max/median {grew['max_median_ratio']:.0f}, max "
        f"{grew['max_activation']:.0f}) but no lasting sink (max-layer first-token attention "
        f"{_span([c['max_layer_sink'] for c in grew['curve']], _fixed(2))} over training); "
        + " and ".join(setup(s) for s in rest)
        + " grow neither (max/median "
        + _span([s["max_median_ratio"] for s in rest], _fixed(0))
        + ", first-token attention "
        + _span([s["max_layer_sink"] for s in rest], _fixed(2))
        + ") within "
        + _span([s["tokens"] / 1e6 for s in runs.values()], _fixed(1))
        + " M tokens"
    )


def cpu_recipe() -> str:
    metrics = _study("cpu_recipe")
    cells = metrics.cells
    plain = [c for c in cells if c.variant == "vanilla"]
    gated = [c for c in cells if c.variant != "vanilla"]
    sinks = [max_layer_sink(c) for c in plain]
    layers = "/".join(map(str, sorted({i for _, i in sinks})))
    big = sum(_known(peak_activation(c)[1]) >= RATIO_TARGET for c in plain)
    ((_, widths),) = bit_sweeps(metrics.schemes).items()

    def w8a8(group) -> tuple[list[Delta], str]:
        deltas = [_known(_change(c, BONDARENKO)) for c in group]
        mean = seed_delta([d.value for d in deltas], "perplexity")
        pooled = format_delta(mean, noise="")  # a t-interval across a few unlike seeds: their spread, no verdict
        return deltas, f"{_changes(deltas)} per seed ({_noise(deltas)}; geometric mean {pooled} across the seeds)"

    def budgets(group) -> str:
        found = [budget([(b, _change(c, s)) for b, s in widths]) for c in group]
        return ", ".join(f"A{f[0]}" if f else f"none (A{widths[0][0]} over)" for f in found)

    (_, ungated_text), (_, twins_text) = w8a8(plain), w8a8(gated)
    twin_of = {c.seed: c for c in gated}

    def paired(scheme: str) -> str:
        """Per seed the gated twin's change minus the ungated one's, paired over the documents both read, with
        the share of the ungated twin's damage it removes; then what the seeds say together (:func:`_across`)."""
        rows = []
        for u in plain:
            gap = change_gap(u, twin_of[u.seed], scheme) if u.seed in twin_of else None
            if gap is not None:
                damage = (_known(_change(u, scheme)).value, _known(_change(twin_of[u.seed], scheme)).value)
                rows.append((u.seed, gap, damage))
        if not rows:
            return "no paired difference (no per-document values)"
        seeds = "; ".join(f"seed {seed} {_delta(gap)}{_share(*damage)}" for seed, gap, damage in rows)
        return f"paired gated minus ungated per seed: {seeds}; {_across([gap for _, gap, _ in rows])}"

    def narrower(bits: int, scheme: str) -> str:
        u, g = [_change(c, scheme) for c in plain], [_change(c, scheme) for c in gated]
        return f"A{bits} {_changes(u)} vs {_changes(g)} ({paired(scheme)})"

    return (
        f"{sum(s >= SINK_TARGET for s, _ in sinks)}/{len(plain)} ungated seeds grow a layer-{layers} sink "
        f"({', '.join(f'{s:.2f}' for s, _ in sinks)}) and max activations "
        f"{_peaks(plain, _fixed(0))}; their G1 twins stay at "
        f"{_span([max_layer_sink(c)[0] for c in gated], _fixed(2))} with mean gate "
        f"{_span([c.summary.gate_mean for c in gated], _fixed(3))} and max "
        f"{_peaks(gated, _fixed(0))}; max/median >= {RATIO_TARGET} in {big} seed{'s' if big != 1 else ''} of "
        f"{len(plain)}; W8A8 at Bondarenko's sites {ungated_text} ungated vs {twins_text} gated "
        f"(t-intervals across {len(plain)} seeds); bit budget (+{BUDGET:.0%}) {budgets(plain)} ungated vs "
        f"{budgets(gated)} gated; at A8 {paired(BONDARENKO)}"
        + "; with fewer activation bits, ungated vs gated: "
        + ", ".join(narrower(b, sch) for b, sch in widths[1:])
    )


def _experiment(name: str):
    """An experiment script as a module (for its own criterion code)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def twins_search() -> str:
    search = _experiment("twins_search")
    results = search.collect(ROOT / "results" / "twins_search")
    parts = []
    for name, metrics in results.items():
        cells, widths = metrics.cells, bit_sweeps(metrics.schemes)[search.W8A8]
        v = search.verdict(cells, widths)
        plain = [c for c in cells if c.variant == "vanilla"]
        gated = [c for c in cells if c.variant != "vanilla"]

        def w8a8(group):
            return _changes([_change(c, search.W8A8) for c in group])

        def copy(group, bits=5, widths=widths):
            scheme = dict(widths)[bits]
            return _span([100 * _known(scheme_change(c, scheme, search.COPY)).value for c in group], _fixed(1), " to ")

        ratios = _span([peak_activation(c)[1] for c in plain], _ratio)
        copies = (
            f"; copy accuracy at A5 {copy(plain)} pp ungated vs {copy(gated)} pp gated"
            if search.COPY[0] in plain[0].float_results
            else ""
        )
        for c in cells:  # --sites: the costliest activation site of each model, where sites.json exists
            found = search.read_sites(c.run_dir).get(c.variant)
            if found:
                total, row = search.costliest_site(found[search.SITE_SCHEMES[0]])
                copies += f"; seed {c.seed} " + search.site_sentence(c.variant, total, row)
        parts.append(
            f"{name} ({v['seeds']} seed{'s' if v['seeds'] != 1 else ''}): ungated sink >= {search.SINK} in "
            f"{v['held']['ungated sink']}, max/median {ratios} (>= {search.RATIO} in "
            f"{v['held']['ungated ratio']}); W8A8 {w8a8(plain)} ungated vs {w8a8(gated)} gated, >= "
            f"{search.FACTOR}x and apart in {v['held']['W8A8 apart']}; widest width apart in every seed: "
            + (f"A{v['widest apart']}" if v["widest apart"] else "none")
            + copies
        )
    met = [n for n, m in results.items() if search.verdict(m.cells, bit_sweeps(m.schemes)[search.W8A8])["met"]]
    return f"criterion met by {', '.join(met) if met else 'no candidate'} of {len(results)}: " + "; ".join(parts)


def mitigations() -> str:
    metrics = _study("mitigations")
    cells = metrics.cells
    fixes = metrics.report.fixes
    assert fixes is not None  # the mitigations study ranks its fixes
    reference, within = fixes.reference, fixes.within
    changes = {(c.id, s): ppl_change(c, s) for c in cells for s in metrics.schemes}
    parts = []
    for c in cells:
        rows = [r for r in fix_rows(c, metrics.schemes, changes, within) if r.scheme != reference]
        fixed = [r for r in rows if r.verdict is Verdict.FIXED]
        text = f"{c.model}: `{reference}` {_delta(changes[c.id, reference])}"
        if fixed:
            text += (
                f", within +{within:.0%} (whole interval) with {len(fixed)} of {len(rows)} schemes, best "
                + ", ".join(f"`{r.scheme}` {_delta(r.delta)}" for r in fixed[:3])
            )
        else:
            text += (
                f", no scheme within +{within:.0%} (whole interval); best `{rows[0].scheme}` {_delta(rows[0].delta)}"
            )
        parts.append(text + f"; worst `{rows[-1].scheme}` {_delta(rows[-1].delta)}")
    return "; ".join(parts)


HEADLINES = {
    f.__name__: f
    for f in (
        quickstart,
        bondarenko_table2,
        bondarenko_table2_paper,
        qiu_table4,
        hyga_ablation,
        sink_leak_toy,
        kv_eviction,
        context_extension,
        massive_activation_intervention,
        cpu_recipe_search,
        cpu_recipe,
        twins_search,
        mitigations,
    )
}


def render(text: str) -> str:
    """``text`` with every headline block regenerated (one block per experiment above)."""
    names = sorted(m.group(2) for m in BLOCK.finditer(text))
    if names != sorted(HEADLINES):
        raise ValueError(f"headline blocks {names} do not match the experiments {sorted(HEADLINES)}")

    def block(m: re.Match) -> str:
        body = HEADLINES[m.group(2)]()
        assert "|" not in body and "\n" not in body, body  # it lives in a table cell
        return f"{m.group(1)}{body}{m.group(4)}"

    return BLOCK.sub(block, text)


CITED = re.compile(r"results/[\w/.-]+?\.md")
INTERVAL = re.compile(r"\[[-+]?[\d.,e+x ]+?, [-+]?[\d.,e+x ]+?\]")
NUMBER = re.compile(r"\d+\.\d+(?:e[+-]\d+)?")


def quoting_pages() -> list[Path]:
    """README.md and every docs page written by hand (docs/reference/ is generated from the code)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


APPROXIMATE = re.compile(r"(?: ~)? approximate")  # what follows an interval the stats rule marks approximate
# words that read a verdict off an interval: none may be drawn from one marked approximate (quantgate.stats)
VERDICT = re.compile(
    r"within noise|no (?:protection|difference|gate effect)\b|needs no\b|rules? out|\bfixed\b|\bresolved\b|certif",
    re.I,
)
SENTENCE = re.compile(r"(?<=[.;])\s+(?=[A-Z(`*-])")


PRECISE = re.compile(r"(?<![\d.])\d+\.\d{3,}(?!\d)")  # a decimal of three places or more: read off a result
CODE = re.compile(r"`[^`]*`")  # a value in code (a setting, a name) is not a quoted result


def _results_text() -> tuple[str, str]:
    """What a paragraph that cites no results page may quote: (every committed results page and record, for its
    intervals; the results pages alone, for its precise decimals, which a record's raw floats would hold by
    accident), each with the headline table written from them."""
    pages = "\n".join(f.read_text(errors="replace") for f in sorted((ROOT / "results").rglob("*.md")))
    records = "\n".join(f.read_text(errors="replace") for f in sorted((ROOT / "results").rglob("*.json")))
    table = "\n".join(m.group(3) for m in BLOCK.finditer(PAGE.read_text()))
    return f"{pages}\n{records}\n{table}", f"{pages}\n{table}"


def _marked_approximate(interval: str, source: str) -> bool:
    """Whether ``source`` marks every occurrence of ``interval`` approximate."""
    ends = [m.end() for m in re.finditer(re.escape(interval), source)]
    return bool(ends) and all(APPROXIMATE.match(source, end) for end in ends)


def misquoted(page: Path, results: tuple[str, str] | None = None) -> list[str]:
    """What ``page`` quotes that the results pages its paragraphs cite do not hold: each interval verbatim, each
    other decimal number (the generated headline blocks are checked against the results by :func:`render`); an
    interval quoted without the "approximate" its source gives it, or with it beside a verdict; and, in a
    paragraph that cites no results page, an interval that no committed results file holds or a decimal of three
    places or more (outside code) that no results page holds. ``results``: :func:`_results_text`, read once for
    many pages."""
    problems = []
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    text = re.sub(r"^```.*?^```", "", BLOCK.sub("", page.read_text()), flags=re.S | re.M)  # code: not quotes
    for paragraph in text.split("\n\n"):
        cited = sorted(set(CITED.findall(paragraph)))
        flat = " ".join(paragraph.split())  # an interval broken across lines is still one interval
        if not cited:
            results = _results_text() if results is None else results  # read once per page, at most
            everything, pages = results
            lost = [q for q in INTERVAL.findall(flat) if q.count(", ") == 1 and q not in everything]
            prose = CODE.sub(" ", INTERVAL.sub(" ", flat))
            lost += [n for n in PRECISE.findall(prose) if n not in pages]
            if lost:
                problems.append(f"{name}: {', '.join(lost)} in no committed results file: {flat[:120]!r}")
            continue
        missing = [c for c in cited if not (ROOT / c).is_file()]
        if missing:
            problems.append(f"{name} cites {', '.join(missing)}, which is not there")
            continue
        source = "\n".join((ROOT / c).read_text() for c in cited)
        quoted = INTERVAL.findall(flat)
        rest = INTERVAL.sub(" ", flat)
        wrong = [q for q in quoted if q not in source] + [n for n in NUMBER.findall(rest) if n not in source]
        if wrong:
            problems.append(f"{name}: {', '.join(wrong)} not in {', '.join(cited)}: {flat[:120]!r}")
        for sentence in SENTENCE.split(flat):
            for m in INTERVAL.finditer(sentence):
                marked = APPROXIMATE.match(sentence, m.end())
                if not marked and _marked_approximate(m.group(), source):
                    problems.append(f"{name}: {m.group()} quoted without the 'approximate' its source gives it")
                elif marked and VERDICT.search(sentence):
                    problems.append(f"{name}: a verdict drawn from the approximate {m.group()}: {sentence[:120]!r}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what this would write")
    args = ap.parse_args()
    old = PAGE.read_text()
    new = render(old)
    if args.check:
        results = _results_text()
        problems = [p for page in quoting_pages() for p in misquoted(page, results)]
        if new != old:
            problems.insert(0, f"{PAGE}: headlines differ from the results; run python scripts/headlines.py")
        if problems:
            sys.exit("\n".join(problems))
    elif new != old:
        PAGE.write_text(new)


if __name__ == "__main__":
    main()
