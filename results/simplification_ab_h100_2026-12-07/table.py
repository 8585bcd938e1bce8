"""The same-call A/B: each figure is the median (range) of a tree's three runs; the ratios are
to 434f221's medians. Run in the folder holding runs/<tree>_<round>.json; the argument names the
commit measured as "head" (default d74501c).

    python table.py [HEAD_COMMIT] > table.md
"""

import json
import statistics
import sys

HEAD = sys.argv[1] if len(sys.argv) > 1 else "d74501c"
TREES = {"old": "434f221", "head3": f"{HEAD}, restart interval 3", "head": HEAD}


def figures():
    data = {}
    for t in TREES:
        for r in (1, 2, 3):
            for row in json.load(open(f"runs/{t}_{r}.json"))["rows"]:
                s = row.get("section")
                if s == "kernels":
                    key, value = (s, row["shape"], f"{row['kind']} (dispatch)"), row.get("gram_ms")
                elif s in ("ortho", "step"):
                    key, value = (
                        (s, row.get("workload") or row["shape"], row["name"]),
                        row.get("ms"),
                    )
                elif s == "memory":
                    key, value = (s, row["workload"], row["name"]), row.get("peak_mib")
                else:
                    continue
                if value is not None:
                    data.setdefault(key, {}).setdefault(t, []).append(value)
    return data


def main():
    unit = {"kernels": "ms", "ortho": "ms", "step": "ms", "memory": "peak MiB"}
    print(
        "| section | shape / workload | row | "
        + " | ".join(TREES.values())
        + f" | {HEAD} at interval 3 / 434f221 | {HEAD} / 434f221 |"
    )
    print("|" + " --- |" * 8)
    for (section, where, name), per in figures().items():
        if not all(len(per.get(t, [])) == 3 for t in TREES):
            continue
        med = {t: statistics.median(per[t]) for t in TREES}
        digits = 0 if section == "memory" else 3
        cells = [
            f"{med[t]:.{digits}f} ({min(per[t]):.{digits}f}-{max(per[t]):.{digits}f})"
            for t in TREES
        ]
        print(
            f"| {section} ({unit[section]}) | {where} | {name} | "
            + " | ".join(cells)
            + f" | {med['head3'] / med['old']:.3f} | {med['head'] / med['old']:.3f} |"
        )


main()
