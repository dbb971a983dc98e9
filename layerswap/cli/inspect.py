"""`layerswap inspect`: whether two experts (and their base) can be merged: headers, and sampled weights
for the shared base; with ``--hardware``, what would serve them on each named hardware (headers only).

Exit status: 0 when the headers agree (compatible), also with a shared-base warning (a warning is not a failure:
it is printed, and merging then needs ``--force``); 1 when they disagree (not compatible); 2 for a user error.
For a shipped pair it also says the plan the pair opens on (`organisms.opening_plan`). With a family (``--lang CODE=L``
repeated) it reports every language expert against the math expert and the base, a block per member (exit 1 when any
disagrees)."""

from __future__ import annotations

from layerswap.engines import EngineSettings
from layerswap.core.errors import UserError
from layerswap.cli.options import check_outputs, emit_json, json_options, models, open_trio, pairing_options


def add_parser(sub) -> None:
    s = sub.add_parser("inspect", help="compatibility report (headers, plus a few MB of sampled weights); "
                                       "--hardware: what would serve the models where")
    models(s, family=True)
    pairing_options(s, force=False)
    s.add_argument("--hardware", metavar="NAME[,NAME...]",
                   help="plan the engines on these Spaces flavours (cpu-basic, cpu-upgrade, t4-small, l4x1, a10g-large, "
                        "l40sx1, a100-large, h100, zero-gpu) or 'this' (this machine), from the headers only; 'all': "
                        "every flavour and this machine")
    json_options(s, "the engine plans of --hardware (a list, one object per hardware)")
    g = s.add_argument_group("engine plan (with --hardware)")
    EngineSettings.add_arguments(g, only=("engine", "serving", "max_model_len", "tensor_parallel_size"),
                                 defaults={"engine": "auto"}, env=False)  # what would serve there, whatever is set here
    s.set_defaults(fn=run)


def run(args) -> int:
    if args.family is not None and len(args.family.members) > 1:
        return family(args)
    if args.hardware:
        return hardware(args)
    if args.json or args.json_out:
        raise UserError("--json and --json-out print the engine plans of --hardware: add --hardware NAME[,NAME...].")
    from layerswap.models.pairing import check_mergeable

    math, lang, base = open_trio(args)
    check = check_mergeable(math, lang, base, threshold=args.base_distance_threshold)
    print(check.report.summary())
    if check.pairing is not None:
        print(("  warning: " if check.pairing.suspicious else "  ") + check.pairing.message())
    if check.report.ok:
        from layerswap.shipped.organisms import opening_plan, organism

        if organism(args.math) is not None:
            opening = opening_plan((args.base or "", args.math, args.lang), math.num_layers)
            print(f"  opens on {opening.plan.title()}: {opening.why}")
    return 0 if check.report.ok else 1


def family(args) -> int:
    """Every member of a family against the math expert and the base: its code, then the pair's report."""
    import textwrap

    from layerswap.models.adapters import open_expert
    from layerswap.models.pairing import check_mergeable
    from layerswap.cli.options import open_checkpoint

    if args.hardware:
        raise UserError("--hardware plans one pair's engines: give one --lang.")
    fam = args.family
    base, math, ok = open_checkpoint(fam.base), open_expert(fam.math, fam.base), True
    for m in fam.members:
        check = check_mergeable(math, open_expert(m.ref, fam.base), base, threshold=args.base_distance_threshold)
        print(f"{m.code} ({m.ref}):")
        print(textwrap.indent(check.report.summary(), "  "))
        if check.pairing is not None:
            print(("    warning: " if check.pairing.suspicious else "    ") + check.pairing.message())
        ok = ok and check.report.ok
    return 0 if ok else 1


def hardware(args) -> int:
    from layerswap.engines import resolve_engine_choice
    from layerswap.engines.planning import hardware_table, table_markdown
    from layerswap.core.hardware import FLAVOURS
    from layerswap.cli.options import open_checkpoint

    names = [n.strip() for n in args.hardware.split(",") if n.strip()]
    if names == ["all"]:
        names = [*FLAVOURS, "this"]
    cks = {"math": open_checkpoint(args.math), "lang": open_checkpoint(args.lang)}
    check_outputs([args.json_out], *cks.values())
    s = EngineSettings.from_args(args)
    rows = hardware_table(cks, names, engine=resolve_engine_choice(s.engine), serving=s.serving, settings=s.vllm())
    if not args.json:
        print(table_markdown(rows))
    emit_json(args, rows)
    return 0
