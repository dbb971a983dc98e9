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
    from ..checkpoints import check_compatible, check_pairing

    math, lang, base = open_trio(args)
    rep = check_compatible(math, lang, base)
    print(rep.summary())
    if rep.ok:
        pairing = check_pairing(math, lang, base, args.base_distance_threshold)
        print(("  warning: " if pairing.suspicious else "  ") + pairing.message())
        return 1 if pairing.suspicious else 0
    return 1
