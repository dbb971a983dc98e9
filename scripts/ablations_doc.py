"""Write docs/ablations.md (tables) and docs/ablations/*.png (figures) from a results file of the sweeps in
assets/sweeps, as `layerswap sweep FILE -o RESULTS --limit N --engine E --device D` wrote it.

    python scripts/ablations_doc.py --results docs/ablations/results.jsonl --limit 30 --engine transformers --device cpu

Only what the results file holds is shown; a sweep with no records (e.g. 4-6 before their experts
are built) is listed with the command that builds and runs it. The settings must be those of the
run (they are part of every point's identity).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerswap.errors import UserError  # noqa: E402
from layerswap.plots import save_figure  # noqa: E402
from layerswap.sweepfiles import load_spec, with_eval  # noqa: E402
from layerswap.sweepreport import stats_table, sweep_figures, table_text  # noqa: E402
from layerswap.sweeps import sweep_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SWEEPS = ["1-counts", "2-transition", "3-location", "4-divergence", "5-lora", "6-bases"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="docs/ablations/results.jsonl")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--engine", default="transformers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/ablations.md")
    ap.add_argument("--intro", default="docs/ablations_intro.md", help="text placed before the generated sections")
    args = ap.parse_args()
    out = Path(args.out)
    figdir = out.with_suffix("")
    figdir.mkdir(parents=True, exist_ok=True)
    intro = Path(args.intro)
    parts = [intro.read_text().rstrip() + "\n"] if intro.exists() else ["# Ablations\n"]
    for name in SWEEPS:
        path = REPO / "assets" / "sweeps" / f"{name}.yaml"
        spec = with_eval(load_spec(path), limit=args.limit)
        spec.engine = {**spec.engine, "engine": args.engine, "device": args.device}
        cmd = (f"layerswap sweep assets/sweeps/{name}.yaml -o {args.results} --limit {args.limit} "
               f"--engine {args.engine} --device {args.device}")
        parts.append(f"## {spec.name}\n\n```bash\n{(spec.build + chr(10)) if spec.build else ''}{cmd}\n```\n")
        try:
            rows = sweep_results(spec, args.results)
        except UserError as e:
            parts.append(f"Not run here: {e}\n")
            continue
        if not rows:
            parts.append("No results yet.\n")
            continue
        parts.append(table_text(rows) + "\n")
        stats = stats_table(rows)
        if stats:
            heads = list(dict.fromkeys(k for r in stats for k in r))
            parts.append("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads) + "\n" + "\n".join(
                "| " + " | ".join(str(r.get(h, "–")) for h in heads) + " |" for r in stats) + "\n")
        for kind, fig in sweep_figures(rows):
            png = figdir / f"{name}-{kind}.png"
            save_figure(fig, png)
            parts.append(f"![{spec.name}: {kind}]({figdir.name}/{png.name})\n")
        print(f"{name}: {len(rows)} records", file=sys.stderr)
    out.write_text("\n".join(parts))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
