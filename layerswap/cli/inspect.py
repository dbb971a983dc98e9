"""`layerswap inspect`: whether two experts (and their base) can be merged: headers, and sampled weights
for the shared base; with ``--hardware``, what would serve them on each named hardware (headers only).

Exit status: 0 when the headers agree (compatible), also with a shared-base warning (a warning is not a failure:
it is printed, and merging then needs ``--force``); 1 when they disagree (not compatible); 2 for a user error.
For a shipped pair it also says the plan the pair opens on (`organisms.opening_plan`). Over a family (`--lang CODE=L`
repeated): every member's compatibility (`models.family.check_family`; a member that does not fit is a user error
naming it), and with ``--hardware`` the family's engine plan per hardware (`engines.family`: which models are awake,
asleep or reloaded, and what a language switch costs)."""

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


def family(args) -> int:
    """A family: each member's compatibility, or (--hardware) the family's engine plan per hardware."""
    from layerswap.models.family import check_family

    fam = args.family
    if not args.hardware:
        checked = check_family(fam, threshold=args.base_distance_threshold)
        print(f"compatible: a family of {len(fam.members)} language experts, {checked.num_layers} layers")
        for code, line in checked.lines.items():
            print(f"  {code}: {line}")
        return 0
    from layerswap.cli.options import open_checkpoint
    from layerswap.core.hardware import FLAVOURS
    from layerswap.engines import resolve_engine_choice
    from layerswap.engines.family import family_hardware_table, family_table_markdown

    names = [n.strip() for n in args.hardware.split(",") if n.strip()]
    if names == ["all"]:
        names = [*FLAVOURS, "this"]
    langs = {m.code: open_checkpoint(m.ref) for m in fam.members}
    s = EngineSettings.from_args(args)
    rows = family_hardware_table(open_checkpoint(fam.math), langs, names, engine=resolve_engine_choice(s.engine),
                                 serving=s.serving, settings=s.vllm())
    check_outputs([args.json_out], *langs.values())
    if not args.json:
        print(family_table_markdown(rows))
    emit_json(args, rows)
    return 0
