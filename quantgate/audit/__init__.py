"""``quantgate audit MODEL``: will this checkpoint survive INT8/FP8, and which recipe should it use?

1. It reads the checkpoint's config and refuses, in one line, a folder that is not a model, a family quantgate
   cannot swap, and a model too large for this machine's memory without ``--device-map`` (:mod:`.target`).
2. It loads the model once, times its forward pass here, and sizes two document sets to the budget
   (:mod:`.plan`, :mod:`.documents`): the *search* set and the *held-out* set (other works).
3. The search (:mod:`.search`): every whole-model scheme of :data:`LADDER` (8-bit first, then fewer bits) is
   quantized once and scored on the search set, each change with its 95% interval paired over the same
   passages; then, for per-tensor static INT8 (and the other simulated schemes, time allowing), the per-site
   fallback (:mod:`.sites`): its Linears ranked by how much each costs, and the fewest of the costliest kept in
   16-bit for the change to lie below the tolerance, found by bisection; at 1%, 2% and 5% for the curve.
4. The certificate (:mod:`quantgate.certify`): the recipes whose change on the search set is below the tolerance,
   the most confident there first (lowest upper end), are tested in turn on the held-out set, computed in float32
   from the same quantized state, until one fails. The answer is the cheapest certified; the chance of certifying a
   recipe whose true change is at or above the tolerance stays at or below 2.5% whatever the search tried
   (benchmarks/certify_rate.py measures it).
5. It writes ``DIR/audit.md`` (the answer first), ``DIR/audit.json`` (:class:`~.record.AuditRecord`) and the
   recipe, as certified, to ``DIR/export``: in compressed-tensors (its kept Linears in ``ignore``) where that
   format holds it, which transformers and vLLM load, else in quantgate's own format.
"""

from __future__ import annotations

from .plan import parse_budget, parse_within
from .run import Audit, audit
from .search import LADDER, REFERENCE, Rung
from .target import AuditError

__all__ = ["audit", "Audit", "Rung", "LADDER", "REFERENCE", "AuditError", "parse_budget", "parse_within"]
