"""`layerswap search` over a family: `--math M --base B --lang CODE=L ...` (two or more language experts).

Each language's plan is searched on that language's own dev questions and held out on its test questions, then
the plan best on average over the languages' dev sets is chosen and held out per language
(`search.family.search_family`). The summary goes to stdout (stderr with `--json`, whose stdout is the JSON);
`--json-out FILE` writes the JSON; the records go to the results file, so a rerun resumes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from layerswap.core.errors import UserError


def run_family_search(args, cfg_of) -> int:
    """`cfg_of(langs)`: the `SearchConfig` the search flags say (cli.search), for these languages."""
    from layerswap.cli.options import Bar, check_outputs, data_inputs, engine_settings, test_data
    from layerswap.search import default_results
    from layerswap.search.family import check, language_configs, search_family

    fam = args.family
    if args.langs:
        raise UserError(f"A family's languages are its codes ({', '.join(fam.codes)}); drop --langs.")
    test_data(args, fam.math, *(m.ref for m in fam.members), fam.base)
    cfg = cfg_of(list(fam.codes))
    results = args.results or str(default_results())
    refs = (fam.math, fam.base, *(m.ref for m in fam.members))
    check_outputs([args.json_out, results], extra=(*refs, *data_inputs(args)))
    say = sys.stderr if args.json else sys.stdout
    configs = language_configs(fam, cfg)
    check(fam, configs, force=args.force, shared_top=args.shared_top)  # everything cheap, before any output
    print(f"search over a family of {len(fam.codes)}: " + "; ".join(
        f"{c} chosen on {'its own dev file' if k.dev_source else 'questions drawn from its set'}"
        for c, k in configs.items())
        + f"; budget {cfg.budget} plans per language, seed {cfg.seed}; the shared plan among each language's "
          f"{args.shared_top} best; records in {results}", file=say)
    bar = Bar(enabled=not args.quiet)
    try:
        result = search_family(fam, cfg, results=results, engine=engine_settings(args, None), force=args.force,
                               progress=bar, shared_top=args.shared_top, workers=args.ray or 0,
                               address=args.ray_address, checked=True)
    finally:
        bar.done()
    print(result.text(), file=say)
    data = result.to_dict()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json_out}", file=say)
    if args.json:
        print(json.dumps(data, indent=1))
    return 0
