"""The audit, start to end (the package docstring says what each step does)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..certify import Test, certifies, fixed_sequence
from ..data import batches as make_batches
from ..eval.tasks import Task
from ..files import claim_output, mark_output, owner, write_text_atomic
from ..model_files import load, save
from ..models.families import family_of
from ..models.io import DTYPES, Placement
from ..models.sources import PACKAGED
from ..models.sources import tokenizer as get_tokenizer
from ..observe import ObserveReport, observe
from ..quant.export import export_format
from ..quant.schemes import get_scheme
from ..stats import Delta, paired_delta, paired_difference, share_removed
from ..study.grid import DataSettings
from . import page
from .documents import DocSet
from .plan import (
    CERTIFY,
    RANKING_PASSES,
    RANKING_TOKENS,
    RATIO,
    SAFETY,
    Speed,
    measure,
    parse_budget,
    parse_within,
    size,
)
from .record import AuditRecord, CandidateRecord, ChangeRecord, CurvePoint, PairRecord
from .search import (
    LADDER,
    REFERENCE,
    SERVE,
    Candidate,
    Fallback,
    Found,
    Pair,
    Rung,
    Search,
    fallback,
    fresh_copy,
    serves,
)
from .sites import can_fall_back
from .target import AuditError, Target, check_memory, dtype_of, target

__all__ = ["audit", "Audit"]

log = logging.getLogger("quantgate")

RANKING = "gradient"  # how the fallback ranks sites (benchmarks/site_ranking.py: 0.99 of the exhaustive top-10 cost)
CURVE = (0.01, 0.02, 0.05)  # the tolerances of the static-INT8 curve (fewest sites kept)
# a fallback's recipes offered to the certificate: the fewest sites within the tolerance on the search documents,
# and the fewest within half of it (a margin: the first is the bisection's boundary, often just too costly held out)
OFFERED = (1.0, 0.5)


@dataclass(frozen=True)
class Audit:
    """What an audit found. ``answer``: audit.md's text, the answer first; ``survives_static_int8``: None where
    that is not resolved; ``recipe``: the cheapest certified recipe (None: none was); ``export``: the folder
    holding it (None: not written), ``export_note``: its format, or why there is none; ``record``: audit.json."""

    out: Path
    answer: str
    survives_static_int8: bool | None
    recipe: str | None
    export: Path | None
    export_note: str
    record: AuditRecord
    changes: dict[str, dict[str, Delta]] = field(default_factory=dict)


@dataclass
class Model:
    """One audited model, loaded: its target, float model, tokenizer, the evaluation task it is read on
    (:attr:`~.target.Target.reads`), calibration and search."""

    target: Target
    float_model: nn.Module
    tok: PreTrainedTokenizerBase
    reads: Task
    calibration: DataSettings
    search: Search | None = None


def _calibration(t: Target, float_model: nn.Module) -> DataSettings:
    if t.task is not None and t.reads.trained_on is not None:  # calibrated on the synthetic task it was trained on
        return DataSettings(data=t.task, batches=8, seq_len=128, batch_size=8)
    context = int(getattr(float_model.config, "max_position_embeddings", None) or 512)
    return DataSettings(data="train", batches=4, seq_len=min(128, context), batch_size=8)


def _load(t: Target, dtype: str, placement: Placement | None) -> Model:
    model = load(t.load, t.variant, dtype=DTYPES[dtype] if dtype != "float32" else None, placement=placement)
    if placement is None and torch.cuda.is_available():
        model = model.to("cuda")
    model.eval()
    return Model(t, model, get_tokenizer(model), t.reads, _calibration(t, model))


def _targets(model: str, variant: str | None, docs: int | None, against: str | None) -> tuple[Target, list[Target]]:
    """The model audited and the models read: with ``against``, the pair (the audited baseline first, the model
    compared second); with a packaged twin, the pair, ungated first."""
    if docs is not None and (isinstance(docs, bool) or not isinstance(docs, int) or docs < 1):
        raise AuditError(f"--docs {docs!r}: give a whole number of passages (or batches) of at least 1")
    focus = target(model, variant)
    if against is not None:
        other = target(against, None)
        if (other.folder, other.variant) == (focus.folder, focus.variant):
            raise AuditError(f"--against {against}: that is the model audited; give the gated model to compare with")
        if other.family.name != focus.family.name:
            raise AuditError(
                f"--against {against}: a {other.family.name} model against a {focus.family.name} one; give two "
                f"checkpoints of one family (the same documents must mean the same to both)"
            )
        return focus, [focus, other]
    twin = PACKAGED[focus.load].twin if focus.load in PACKAGED else None
    if twin is None:
        return focus, [focus]
    other = target(twin, None)
    pair = sorted([focus, other], key=lambda t: target(t.load, None).variant is not None)  # ungated first
    return focus, pair


@contextmanager
def _progress(total_s: float, enabled: bool) -> Iterator[tqdm]:
    """One bar for the whole audit, in estimated seconds, ticking with the clock (ETA: the estimate left)."""
    total = max(round(total_s), 1)
    bar = tqdm(total=total, unit="s", desc="audit", disable=None if enabled else True, leave=True)
    start, stop = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.n = min(round(time.perf_counter() - start), total - 1)
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        bar.n = total
        bar.close()


def _ladder(schemes: list[str] | None) -> list[Rung]:
    """The default ladder, or the schemes given (the question, static INT8, first)."""
    if not schemes:
        return list(LADDER)
    known = {r.scheme: r for r in LADDER}
    names = list(dict.fromkeys(str(get_scheme(s)) for s in schemes))  # an unknown one fails, naming the registry
    names = [REFERENCE, *(n for n in names if n != REFERENCE)]
    return [known[n] if n in known else Rung(n, "-", get_scheme(n).range_kind()) for n in names]


def _runnable(ladder: list[Rung], model: nn.Module) -> list[Rung]:
    """The rungs the model can run (a weight group size must divide each Linear's input width); one left out is
    logged with why."""
    widths = frozenset(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    kept = []
    for rung in ladder:
        why = get_scheme(rung.scheme).unfit(widths)
        if why:
            log.info("audit: %s left out: %s", rung.scheme, why)
        else:
            kept.append(rung)
    return kept


def _observe(m: Model) -> ObserveReport | None:
    """The float model's outliers and sinks on 3 held-out batches (the audit's "why"); None for a model of a
    synthetic task."""
    if m.reads.trained_on is not None:
        return None
    seq = m.calibration.seq_len
    data = make_batches(m.tok, "validation", seq, 4, family_of(m.float_model).objective, max_batches=3)
    return observe(m.float_model, data, progress=False)


class Clock:
    """The audit's time: since it started, and what is left of the budget's planned share."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s * SAFETY - self.spent()


def audit(
    model: str,
    out: str | Path | None = None,
    *,
    budget: str | float = "10m",
    within: str | float = 0.01,
    variant: str | None = None,
    dtype: str | None = None,
    placement: Placement | None = None,
    schemes: list[str] | None = None,
    docs: int | None = None,
    export: bool = True,
    serve: str = "any",
    against: str | None = None,
    progress: bool = True,
) -> Audit:
    """Audit ``model`` (a folder saved by transformers or quantgate, a packaged name, a cached hub id) for INT8/FP8
    within ``budget`` (seconds or ``10m``) and tolerance ``within`` (a fraction, or ``1%``); writes ``out``
    (default ``audits/<name>``): audit.md, audit.json and the export (package docstring). ``schemes``: try these
    whole-model schemes instead of :data:`LADDER`; ``docs``: passages (or batches) in each document set (default:
    as many as the budget allows); ``serve``: ``vllm-cpu`` certifies only recipes vLLM-CPU has kernels for
    (:func:`~.search.serves`); ``against``: a gated model of the same family and tokenizer, read on the same
    documents with the same calibration and schemes, whose change minus ``model``'s each scheme reports (the
    recipe search and the export stay ``model``'s)."""
    if serve not in SERVE:
        raise AuditError(f"--serve {serve!r}: one of {', '.join(SERVE)}")
    clock = Clock(parse_budget(budget))
    tolerance = parse_within(within)
    focus, targets = _targets(model, variant, docs, against)
    dtype = dtype_of(focus, dtype)
    for t in targets:
        check_memory(t, dtype, placement)
    ladder = _ladder(schemes)
    models = [_load(t, dtype, placement) for t in targets]
    if against is not None:
        _same_tokens(models)
    out = Path(out) if out is not None else Path("audits") / focus.name
    out = claim_output(out, "audit", "--out", inputs=[t.folder for t in targets])  # marked once it writes
    main = models[targets.index(focus)]
    if not schemes:  # what the model can run and the target serve (static INT8, the question, always)
        ladder = [r for r in _runnable(ladder, main.float_model) if serves(r.scheme, serve) or r.scheme == REFERENCE]
    speed = measure(main.float_model, 512 if main.reads.rolling else 128)
    sets = _sets(main, speed, ladder, clock, docs)
    ms = (1000 * speed.per_token_s, 1000 * speed.per_token_fp32_s)
    log.info("audit of %s: %s to search, %s held out; %.2f ms a token here (%.2f in float32)", focus.name,
             sets[0].describe(), sets[1].describe(), *ms)  # fmt: skip
    with _progress(clock.left(), progress) as bar:
        found = _search(models, main, ladder, sets, tolerance, clock, bar, placement, dtype, speed)
        bar.set_description("audit: certifying")
        tests = _certify(main, found, sets[1], tolerance, serve)
    compared = targets[1].name if against is not None else None
    return _finish(main, found, tests, sets, tolerance, clock, out, dtype, export, serve, compared)


def _same_tokens(models: list[Model]) -> None:
    """Refuse a pair whose tokenizers differ: the same documents would be other tokens, and no difference paired
    over them would compare like with like."""
    a, b = (m.tok.get_vocab() for m in models)
    if a != b:
        names = [m.target.name for m in models]
        raise AuditError(
            f"{names[0]} and {names[1]} tokenize differently ({len(a):,} and {len(b):,} tokens, "
            f"{len(a.keys() ^ b.keys()):,} not in both, or the same ones numbered otherwise); compare two models "
            f"that share one tokenizer"
        )


def _sets(m: Model, speed: Speed, ladder: list[Rung], clock: Clock, docs: int | None) -> tuple[DocSet, DocSet]:
    """The search and held-out sets, sized to the budget (:func:`~.plan.size`)."""
    probe = DocSet(m.reads, "search", 18 if m.reads.rolling else 1)
    per_unit = probe.tokens(m.tok) / probe.n
    n = size(m.reads.unit, speed, per_unit, len(ladder), clock.budget_s, clock.spent(), docs)
    return DocSet(m.reads, "search", n), DocSet(m.reads, "held-out", n)


def _fresh(m: Model, placement: Placement | None, dtype: str):
    if placement is None:
        return fresh_copy(m.float_model)
    return lambda: load(m.target.load, m.target.variant, dtype=DTYPES[dtype] if dtype != "float32" else None,
                        placement=placement)  # fmt: skip


def _search(models: list[Model], main: Model, ladder: list[Rung], sets: tuple[DocSet, DocSet], tolerance: float,
            clock: Clock, bar, placement: Placement | None, dtype: str, speed: Speed) -> Found:  # fmt: skip
    """Every whole-model rung on every model, then the fallbacks of the audited model, while time is left (a
    share kept for the certificate)."""
    for m in models:
        m.search = Search(m.float_model, m.tok, m.calibration, sets[0], tolerance, _fresh(m, placement, dtype))
    report = _observe(main)
    reserve = _certify_reserve(main, sets[1], speed)
    candidates: list[Candidate] = []
    cut: list[str] = []
    pairs: dict[str, Pair] = {}
    for rung in sorted(ladder, key=lambda r: r.probe):
        per = max((c.seconds for c in candidates), default=0.0) * len(models)
        if candidates and clock.left() - reserve < per:
            cut.append(rung.scheme)
            continue
        bar.set_description(f"audit: {rung.scheme}")
        runs = {id(m): m.search.whole(rung.scheme) for m in models if m.search is not None}
        candidates.append(runs[id(main)])
        if len(models) == 2:
            first, second = (runs[id(m)].search for m in models)
            pairs[rung.scheme] = Pair(first, second, _gap(models, runs, rung.scheme))
    fallbacks, curve = _fallbacks(main, candidates, tolerance, clock, reserve, bar, cut, _fallback_s(main, speed))
    assert main.search is not None
    for f in fallbacks:
        candidates += [f.candidate(main.search, k) for k in sorted(_chosen(f, tolerance))]
    return Found(candidates, fallbacks, cut, pairs, report, curve)


def _gap(models: list[Model], runs: dict[int, Candidate], scheme: str) -> Delta:
    """The second model's change minus the first's under ``scheme`` (the gated twin's minus the ungated one's, or
    the model given --against minus the audited one's), paired over the same documents."""
    ungated, gated = models
    assert ungated.search is not None and gated.search is not None
    u, g = runs[id(ungated)].scores, runs[id(gated)].scores  # what each scored on the search set
    assert u is not None and g is not None  # a whole-model candidate keeps its scores
    return paired_difference((ungated.search.float_docs, u), (gated.search.float_docs, g), "perplexity",
                             cluster=ungated.search.docs.cluster)  # fmt: skip


def _chosen(f: Fallback, tolerance: float) -> set[int]:
    """The numbers of sites kept that the fallback offers as recipes: the fewest its bisections at ``tolerance`` and
    at the shares of it in :data:`OFFERED` found (not a smaller one that passed by luck during the curve's)."""
    found = (f.found.get(tolerance * share) for share in OFFERED)
    return {k for k in found if k is not None}


def _fallback_s(m: Model, speed: Speed) -> float:
    """Seconds a fallback needs at the least: ranking the sites, and three scorings of the search set."""
    assert m.search is not None
    score = m.search.docs.tokens(m.tok) * speed.per_token_s * RATIO
    return RANKING_TOKENS * speed.per_token_s * RANKING_PASSES + 3 * score


def _fallbacks(main: Model, candidates: list[Candidate], tolerance: float, clock: Clock, reserve: float, bar,
               cut: list[str], per: float) -> tuple[list[Fallback], list[CurvePoint]]:  # fmt: skip
    """The per-site fallbacks of the audited model's simulated schemes not within the tolerance, the question
    (static INT8) first, while time is left; the static-INT8 curve at :data:`CURVE`."""
    assert main.search is not None
    bases = [c for c in candidates if can_fall_back(c.scheme) and not certifies(c.search, tolerance)]
    bases.sort(key=lambda c: (c.scheme != REFERENCE, c.cost.key()))
    ranking = main.search.ranking_batches()
    done: list[Fallback] = []
    curve: list[CurvePoint] = []
    for base in bases:
        if clock.left() - reserve < per:
            cut.append(f"{base.scheme} (per-site fallback)")
            continue
        bar.set_description(f"audit: fallback of {base.scheme}")
        f = fallback(main.search, base.scheme, RANKING, ranking)
        deadline = time.perf_counter() + clock.left() - reserve
        for share in OFFERED:
            f.fewest(main.search, tolerance * share, deadline)
        if base.scheme == REFERENCE:
            for tol in CURVE:
                k = f.fewest(main.search, tol, deadline)
                kept = None if k is None else len(f.sites.linear_names(f.order[:k]))  # Linears, not fused sites
                curve.append(CurvePoint(tol, kept, ChangeRecord.of(f.tried.get(k)) if k is not None else None))
        done.append(f)
    return done, curve


def _certify_reserve(m: Model, held: DocSet, speed: Speed) -> float:
    """Seconds kept for the certificate: the float model and up to :data:`~.plan.CERTIFY` recipes on the held-out
    set, in float32."""
    return held.tokens(m.tok) * speed.per_token_fp32_s * (1 + RATIO * CERTIFY)


def _certify(m: Model, found: Found, held: DocSet, tolerance: float, serve: str) -> list[Test]:
    """Fixed-sequence certification (:func:`~quantgate.certify.fixed_sequence`) of the recipes whose change on the
    search set is below the tolerance (the estimate: the held-out test alone carries the guarantee, and a stricter
    entry only costs power, benchmarks/certify_rate.py), on the held-out set in float32. The order is fixed by the
    search's documents alone: whole-model recipes first, most confident there first (the lowest upper end), then
    the per-site fallbacks. A fallback's bisection picks the fewest sites whose search interval just passes, so
    that interval is the most favourable of those it read and says less of the held-out change than a whole-model
    recipe's: tested first, its failure would end the sequence before a sounder recipe is read."""
    order = [c for c in found.candidates if c.search is not None and c.search.value < tolerance]
    order = [c for c in order if serves(c.scheme, serve)]
    order.sort(key=lambda c: (bool(c.kept), c.search.high if c.search and c.search.high is not None else 1.0))
    if not order:
        return []
    float32 = copy.deepcopy(m.float_model).float()
    reference = held.score(float32, m.tok)
    del float32
    by_name = {c.scheme: c for c in order}
    assert m.search is not None
    search = m.search

    def measure_held(name: str) -> Delta:
        c = by_name[name]
        if c.model is None:
            c.model = search.quantize(c.scheme)
        scored = copy.deepcopy(c.model).float()
        d = paired_delta(reference, held.score(scored, m.tok), held.metric, cluster=held.cluster)
        c.held_out = d
        return d

    names = [c.scheme for c in order]
    return fixed_sequence(names, measure_held, tolerance)


def _finish(main: Model, found: Found, tests: list[Test], sets: tuple[DocSet, DocSet], tolerance: float,
            clock: Clock, out: Path, dtype: str, export: bool, serve: str, against: str | None) -> Audit:  # fmt: skip
    """Write the export, audit.json and audit.md; the answer."""
    certified = [c for c in found.candidates if any(t.certified and t.name == c.scheme for t in tests)]
    chosen = min(certified, key=lambda c: c.cost.key(), default=None)  # the cheapest certified
    recipe = chosen.scheme if chosen is not None else None
    out.mkdir(parents=True, exist_ok=True)  # checked by claim_output before the work; marked now that it writes
    mark_output(out, "audit", by="quantgate audit")
    export_dir, note = _export(main, chosen, out / "export") if export and chosen else (None, "")
    if export_dir is None and (out / "export").is_dir() and owner(out / "export") is not None:
        shutil.rmtree(out / "export")  # an earlier audit's, which this audit.md would not describe
    if not export:
        note = "not asked for (--no-export)"
    elif chosen is None:
        note = "no recipe was certified"
    record = dataclasses.replace(
        _record(main, found, tests, sets, tolerance, clock, dtype, recipe), serve=serve, against=against,
        pair=[_pair_record(scheme, pair) for scheme, pair in found.pairs.items()],
    )  # fmt: skip
    write_text_atomic(out / "audit.json", _json(record))
    text = page.text(main.target, record, found, tests, tolerance, export_dir, note, clock.spent(), clock.budget_s)
    write_text_atomic(out / "audit.md", text)
    static = next((c.search for c in found.candidates if c.scheme == REFERENCE), None)
    survives = None if static is None or not static.decisive else certifies(static, tolerance)
    if survives is False and static is not None and static.low is not None and static.low < tolerance:
        survives = None  # straddles the tolerance: not resolved
    changes = {main.target.name: {c.scheme: c.search for c in found.candidates if c.search is not None}}
    return Audit(out, text, survives, recipe, export_dir, note, record, changes)


def _pair_record(scheme: str, pair: Pair) -> PairRecord:
    first, second, gap = pair
    share = share_removed(first.value, second.value) if first is not None and second is not None else None
    return PairRecord(scheme, ChangeRecord.of(first), ChangeRecord.of(second), ChangeRecord.of(gap), gap.kind, share)


def _json(record: AuditRecord) -> str:
    import json

    return json.dumps(record.to_json(), indent=1) + "\n"


def _record(m: Model, found: Found, tests: list[Test], sets: tuple[DocSet, DocSet], tolerance: float,
            clock: Clock, dtype: str, recipe: str | None) -> AuditRecord:  # fmt: skip
    certified = {t.name for t in tests if t.certified}
    rows = [
        CandidateRecord(
            scheme=c.scheme,
            base=c.base,
            kept=list(c.kept),
            compute_bits=c.cost.compute_bits,
            weight_bits=c.cost.weight_bits,
            work=c.cost.work,
            kept_share=c.cost.kept_share,
            search=ChangeRecord.of(c.search),
            held_out=ChangeRecord.of(c.held_out),
            certified=c.scheme in certified,
            seconds=c.seconds,
        )
        for c in found.candidates
    ]
    ref = next((f for f in found.fallbacks if f.base == REFERENCE), None)
    return AuditRecord(
        model=m.target.name, dtype=dtype, tolerance=tolerance, budget_s=clock.budget_s, seconds=clock.spent(),
        search_documents=sets[0].describe(), held_out_documents=sets[1].describe(), candidates=rows,
        order=[t.name for t in tests], recipe=recipe, ranking=ref.method if ref else None,
        ranked_sites=ref.order if ref else [], curve=found.curve, cut=found.cut,
    )  # fmt: skip


def _export(m: Model, chosen: Candidate, folder: Path) -> tuple[Path, str]:
    """Save the certified recipe's own model (the state the certificate scored) to ``folder``: (the folder, its
    format in words)."""
    assert chosen.model is not None
    kind, why = export_format(chosen.model, get_scheme(chosen.scheme))
    claim_output(folder, "model", "the audit's export", overwrite=True)
    save(chosen.model, folder, m.tok)
    if kind == "quantgate":
        return folder, f"quantgate's own format, which transformers and vLLM refuse: {why}"
    return folder, f"{kind} format"
