"""`layerswap merge`: merge two experts with a recipe and write the result as an HF folder (optionally pushed)."""

from __future__ import annotations

from layerswap.core.errors import UserError
from layerswap.cli.options import (Bar, DEVICE_HELP, models, open_trio, pairing_options, parse_size, plan_note,
                                   print_recipe, recipe_from, recipe_options)
from layerswap.cli.push import push_folder


def add_parser(sub) -> None:
    s = sub.add_parser("merge", help="build the layer-swapped (or baseline) model and write it as an HF folder")
    models(s, family=True)
    s.add_argument("--lang-recipe", action="append", metavar="CODE=FILE",
                   help="a family (--lang CODE=L repeated): this language's swap from a recipe file instead of the "
                        "shared plan; repeatable")
    recipe_options(s)
    pairing_options(s)
    s.add_argument("--device", default="auto", help=f"where computed tensors are merged: {DEVICE_HELP}")
    s.add_argument("-o", "--out", required=True, help="output folder (must not exist, unless --overwrite)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    s.add_argument("--out-shard-size", default="5GB", help="maximum bytes per safetensors shard (default 5GB)")
    s.add_argument("--languages", metavar="CODES",
                   help="comma list of ISO 639 codes the merge is for (e.g. sw,en), for the model card's front matter")
    s.add_argument("--adapter", action="store_true",
                   help="two PEFT adapters of one kind (LoRA, IA3, prefix tuning) as experts: write the swap as a PEFT "
                        "adapter of that kind on their base (prefix-tuning experts can only be exported so)")
    s.add_argument("--push-to", metavar="REPO_ID", help="then push the folder to your own Hub repo (see `layerswap push`)")
    s.add_argument("--private", action="store_true", help="with --push-to: create the repo private")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=run)


def run(args) -> int:
    from layerswap.merge.merging import export_adapter_merge, export_merge, exports_as_adapter

    if args.push_to:  # a bad repo id or no network is said before a long merge, not after
        from layerswap.models.hub import hub_reachable
        from layerswap.merge.publish import check_repo_id

        check_repo_id(args.push_to)
        if not hub_reachable():
            raise UserError("--push-to needs the Hugging Face Hub, which is not reachable from this machine; "
                            "merge without it now and run `layerswap push` later.")
    if args.family is not None:
        return run_family(args)
    if args.lang_recipe:
        raise UserError("--lang-recipe is for a family: give each language expert with its code, --lang CODE=L.")
    math, lang, base = open_trio(args)
    recipe = recipe_from(args, math.num_layers)
    print_recipe(recipe, math.num_layers, plan_note(args, math.num_layers))
    languages = args.languages.split(",") if args.languages else None
    if exports_as_adapter(math, lang, args.adapter):  # two prefix-tuning experts: only as an adapter
        out = export_adapter_merge(math, lang, recipe, args.out, base=base, overwrite=args.overwrite,
                                   force=args.force, languages=languages)
        why = "" if args.adapter else "; a swap of prefix-tuning experts exists only on the adapters"
        print(f"wrote {out} (a {math.adapter_kind} adapter on the experts' base{why})")
        if args.push_to:
            push_folder(out, args.push_to, private=args.private, revision=None, overwrite=False, quiet=args.quiet)
        return 0
    bar = Bar(enabled=not args.quiet)
    s = export_merge(math, lang, recipe, args.out, base=base, device=args.device,
                     overwrite=args.overwrite, shard_bytes=parse_size(args.out_shard_size), force=args.force,
                     base_distance_threshold=args.base_distance_threshold, progress=bar,
                     languages=languages)
    bar.done()
    if s.pairing is not None and s.pairing.suspicious:
        print("warning (--force): " + s.pairing.message().replace("; pass --force to run it anyway", ""))
    print(f"wrote {s.out} ({s.n_tensors} tensors: {s.n_copied} copied, {s.n_blended} computed; "
          f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard{'s' if s.shards > 1 else ''})")
    if args.push_to:
        push_folder(s.out, args.push_to, private=args.private, revision=None, overwrite=False, quiet=args.quiet)
    return 0


def run_family(args) -> int:
    """A family: one export folder per language under --out (`merge.family_export.export_family`), each with its
    card and mergekit YAML; the shared plan from the flags, or a language's own from --lang-recipe."""
    from layerswap.cli.family import lang_recipes
    from layerswap.cli.options import open_checkpoint
    from layerswap.merge.family_export import export_family
    from layerswap.models.adapters import open_expert

    if args.push_to or args.languages:
        raise UserError("A family's export is a folder per language, each with its code in its card: drop "
                        "--push-to and --languages (push each folder with `layerswap push`).")
    fam = args.family
    base = open_checkpoint(fam.base) if fam.base else None
    math = open_expert(fam.math, fam.base)
    langs = {m.code: open_expert(m.ref, fam.base) for m in fam.members}
    shared = recipe_from(args, math.num_layers)
    plans = {**{c: shared for c in fam.codes}, **lang_recipes(args, fam.codes)}
    for code in fam.codes:
        print(f"{code}: ", end="")
        print_recipe(plans[code], math.num_layers, "" if plans[code] is not shared else plan_note(args, math.num_layers))
    bar = Bar(enabled=not args.quiet)
    done = export_family(math, langs, plans, args.out, base=base, device=args.device, overwrite=args.overwrite,
                         shard_bytes=parse_size(args.out_shard_size), force=args.force,
                         base_distance_threshold=args.base_distance_threshold, adapter=args.adapter, progress=bar)
    bar.done()
    for code, s in done.items():
        print(f"wrote {getattr(s, 'out', s)} ({code})")
    return 0
