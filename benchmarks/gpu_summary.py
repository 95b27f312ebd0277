"""The one summary table of benchmarks/gpu_proof.sh, from the files its steps left in OUT.

    python benchmarks/gpu_summary.py OUT [--min-ratio 1.5] [--limit-s 420] [--dry-run]

Reads OUT/steps.tsv (step, exit status, seconds, note: written by the shell script), OUT/install.json,
OUT/parity.json, OUT/moe_parity.json, OUT/sinks_parity.json and OUT/mla_parity.json (gpu_parity.py), OUT/tp1.json
and OUT/tp2.json
(throughput.py --json). Prints one table (check | result | verdict) and exits 1 if any check failed. In a dry run
the throughput ratio is not judged (a CPU says nothing about a GPU's speed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(out: Path) -> dict[str, dict]:
    steps = {}
    path = out / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, secs, note = (line.split("\t") + ["", "", ""])[:4]
            steps[name] = {"rc": int(rc), "s": float(secs or 0), "note": note}
    return steps


def throughput_rows(data, tp: str, min_ratio: float | None) -> list[tuple[str, str, bool | None]]:
    by = {r["engine"]: r for r in data["results"]}
    ours = by.get("lockstep")
    rows = []
    if ours is None:
        return [(f"throughput TP={tp}", "no lockstep result", False)]
    ours_tps = sum(ours["counts"]) / ours["wall"]
    notes = "; ".join(n for n in ours.get("notes", []) if "cuda_graph" in n)
    text = f"lockstep {ours_tps:.0f} tok/s ({data['dtype']}, {data['device']})"
    hf = by.get("transformers")
    if hf is None:
        rows.append((f"throughput TP={tp}", text + (f"; {notes}" if notes else ""), data["all_exact"]))
        return rows
    hf_tps = sum(hf["counts"]) / hf["wall"]
    ratio = ours_tps / hf_tps
    text += f", transformers CB {hf_tps:.0f} tok/s, ratio {ratio:.2f}x"
    fast = None if min_ratio is None else ratio >= min_ratio
    rows.append((f"throughput TP={tp} vs transformers", text, data["all_exact"] and fast is not False))
    if notes:
        rows.append((f"throughput TP={tp} graphs", notes, None))
    attention = "; ".join(n for n in ours.get("notes", []) if n.startswith("attention"))
    if attention:  # which attention kernel ran (cluster.config.attention_decision's note)
        rows.append((f"throughput TP={tp} attention", attention, None))
    return rows


def summary_rows(out: Path, min_ratio: float | None, limit_s: float) -> list[tuple[str, str, bool | None]]:
    steps = read_steps(out)
    rows: list[tuple[str, str, bool | None]] = []
    install = load(out / "install.json")
    if install:
        rows.append(("install keeps torch and transformers", install["result"], install["ok"]))
    for name, step in steps.items():
        if step["rc"] == 0:
            continue
        why = step["note"] or f"exit status {step['rc']}"
        rows.append((f"step {name}", why, None if step["rc"] == 200 else False))  # 200: skipped
    for file, what in (("parity.json", "parity checks"), ("moe_parity.json", "MoE parity checks"),
                       ("sinks_parity.json", "gpt-oss (sliding + sinks) parity checks"),

                       ("mla_parity.json", "MLA parity checks")):
        parity = load(out / file)
        if parity is None:
            rows.append((what, "no result (see the step's log)", False))
        else:
            rows += [(r["check"], r["result"], r["ok"]) for r in parity]
    for tp in ("1", "2"):
        data = load(out / f"tp{tp}.json")
        if data is not None:
            rows += throughput_rows(data, tp, min_ratio)
        elif tp == "1":
            rows.append(("throughput TP=1", "no result (see the step's log)", False))
    total = sum(s["s"] for s in steps.values())
    rows.append(("total time", f"{total:.0f} s (limit {limit_s:.0f} s)", total <= limit_s))
    return rows


def print_table(rows: list[tuple[str, str, bool | None]]) -> None:
    w = max(len(r[0]) for r in rows)
    print("\n" + "=" * 30 + " gpu_proof summary " + "=" * 30)
    print(f"{'check':<{w}}  {'verdict':<7}  result")
    for check, result, ok in rows:
        verdict = {True: "PASS", False: "FAIL", None: "-"}[ok]
        print(f"{check:<{w}}  {verdict:<7}  {result}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--min-ratio", type=float, default=1.5)
    p.add_argument("--limit-s", type=float, default=420, help="the time budget: gpu_proof.sh's LIMIT_S")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    rows = summary_rows(Path(args.out), None if args.dry_run else args.min_ratio, args.limit_s)
    print_table(rows)
    return 1 if any(ok is False for _, _, ok in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
