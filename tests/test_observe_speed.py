"""observe's histogram (issue 44): the counts of torch.histc, by cheaper arithmetic."""

from __future__ import annotations

import importlib

import torch

ob = importlib.import_module("quantgate.observe")  # the module (quantgate.observe is also the function)


def test_histogram_counts_are_histc_counts():
    """|x| on, just above and just below every bin edge, spread over 22 decades, and 0 / tiny / huge values:
    the same counts as torch.histc over the clamped log10 values, bin for bin."""
    edges = (10 ** torch.linspace(ob.LOG_LO, ob.LOG_HI, ob.LOG_BINS + 1, dtype=torch.float64)).float()[1:-1]
    up, down = edges.nextafter(torch.tensor(1e30)), edges.nextafter(torch.tensor(0.0))
    spread = 10 ** (torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 22 - 11)
    x = torch.cat([edges, up, down, spread, torch.tensor([0.0, 1e-30, 1e-10, 1e10, 1e30, 3e38])])
    logs = torch.log10(x.clamp_min(10**ob.LOG_LO)).clamp_max_(ob.LOG_HI - 1e-6)
    reference = torch.histc(logs, bins=ob.LOG_BINS, min=ob.LOG_LO, max=ob.LOG_HI).double()
    counts = ob._histogram(x.clone())
    assert torch.equal(counts, reference)
    assert counts[0] > 0 and counts[-1] > 0  # both ends reached
