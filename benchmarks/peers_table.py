"""The table of benchmarks/peers.sh: output tok/s and median TPOT of each engine at each
concurrency, and tidal's throughput ratio to each peer."""

import json
import sys
from pathlib import Path

folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/peers")
runs = {}
for path in folder.glob("*-c*.json"):
    engine, conc = path.stem.rsplit("-c", 1)
    runs[(engine, int(conc))] = json.loads(path.read_text())
engines = [e for e in ("tidal", "tidal-dense", "tidal-int4", "vllm", "llama") if any(k[0] == e for k in runs)]
ours = [e for e in engines if e.startswith("tidal")]
pairs = [(o, p) for o in ours for p in engines if p not in ours]
print("| concurrency | " + " | ".join(f"{e} tok/s (TPOT ms)" for e in engines)
      + "".join(f" | {o} / {p}" for o, p in pairs) + " |")
print("|---" * (1 + len(engines) + len(pairs)) + "|")
for conc in sorted({k[1] for k in runs}):
    cells = []
    for e in engines:
        r = runs.get((e, conc))
        cells.append(f"{r['output_throughput']:.1f} ({r['median_tpot_ms']:.1f})" if r else "-")
    for o, p in pairs:
        t, q = runs.get((o, conc)), runs.get((p, conc))
        cells.append(f"{t['output_throughput'] / q['output_throughput']:.2f}x" if t and q else "-")
    print(f"| {conc} | " + " | ".join(cells) + " |")
