"""`layerswap inspect`: whether two experts (and their base) can be merged: headers, and sampled weights
for the shared base."""

from __future__ import annotations

from .options import models, open_trio, pairing_options


def add_parser(sub) -> None:
    s = sub.add_parser("inspect", help="compatibility report (headers, plus a few MB of sampled weights)")
    models(s)
    pairing_options(s, force=False)
    s.set_defaults(fn=run)


def run(args) -> int:
    from ..pairing import check_mergeable

    math, lang, base = open_trio(args)
    check = check_mergeable(math, lang, base, threshold=args.base_distance_threshold)
    print(check.report.summary())
    if check.pairing is not None:
        print(("  warning: " if check.pairing.suspicious else "  ") + check.pairing.message())
    return 1 if check.problem() else 0
