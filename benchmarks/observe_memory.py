"""Peak memory of observe (O(N) per layer) against an eager ``output_attentions`` run, same model.

    python benchmarks/observe_memory.py                 # tiny-llama, N = 1k .. 8k tokens, batch 1

Each measurement runs in a fresh subprocess and reports the growth of its peak resident memory
(ru_maxrss) over the footprint after loading the model, so runs cannot inherit each other's peak.
The eager reference materialises the (heads x N x N) probabilities of every layer; the script fits
its growth with a*N^2 and prints the length at which it would exceed this machine's memory.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys


def measure(mode: str, preset: str, n: int) -> float:
    """MiB of peak RSS growth for one forward pass at length n (runs in this process)."""
    import torch

    import quantgate as qg
    from quantgate.observe import observe

    model = qg.build(preset).eval()
    ids = torch.randint(5, model.config.vocab_size, (1, n))
    if mode == "eager":
        model.set_attn_implementation("eager")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        if mode == "eager":
            out = model(ids, output_attentions=True)
            assert out.attentions[0].shape[-1] == n
        else:
            observe(model, [{"input_ids": ids}], progress=False)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, preset, n = args.child
        print(json.dumps(measure(mode, preset, int(n))))
        return
    rows = []
    for n in args.lengths:
        mib = {}
        for mode in ("observe", "eager"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, args.preset, str(n)], capture_output=True,
                                 text=True, check=True)
            mib[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((n, mib["observe"], mib["eager"]))
    total = _mem_total_mib()
    print(f"{args.preset}, batch 1; peak RSS growth over the loaded model (MiB); machine memory {total:.0f} MiB")
    print("| tokens | observe | eager output_attentions | eager / observe |\n|---|---|---|---|")
    for n, o, e in rows:
        print(f"| {n} | {o:.0f} | {e:.0f} | {e / max(o, 1):.1f} |")
    (n1, _, e1), (n2, _, e2) = rows[-2], rows[-1]
    a = (e2 - e1) / (n2**2 - n1**2)  # eager grows as a * N^2
    if a > 0:
        limit = math.sqrt(max(total - e2 + a * n2**2, 0) / a)
        print(f"eager grows ~{a * 1024**2:.0f} MiB per (1k tokens)^2: it would exceed {total:.0f} MiB near "
              f"N = {limit:,.0f} tokens; observe's growth is linear in N")


def _mem_total_mib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
