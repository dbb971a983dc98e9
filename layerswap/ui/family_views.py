"""A loaded family's strips, heatmaps and export in the page (the family itself is `ui.family`'s).

- **Strips per language**: under the family's lines, the layer sources of each language's merge, a row per code
  (`plan_strips`: its own line or the page's plan, `PlanControls.for_language`), following Load family, the lines
  and the plan controls.

- **Heatmaps per language**: the analysis tab's *Language expert* menu lists the visitor's family (`menu`, filled
  when the tab opens); choosing a code (`choose`, bounded to the family's codes) makes every view of the tab (its
  heatmaps, depth profile, tables, plan overlay and the weight-diff prior) that language's pair: the family's math
  expert and that language expert against the family's base (`pair_view`). The analyses of all the languages come
  from one `analysis.analyze_family` run (base and math read once, every pair cached on disk as `analyze` caches
  it) and are kept on the visitor for its family; the plan overlay is that language's own plan when the
  per-language plans give it one, else the page's (`overlay`).
- **Export per family**: the Evaluate tab's family section writes one folder per language
  (`merge.family_export.export_family`: weights, card, mergekit YAML) into the visitor's own folder, never a server
  path, within the disk budgets (`files.Budget`), each language with the page's plan or its own per-language plan
  (`controls.own_plans`), then offers the whole family as one zip when it is within the download cap.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator

import gradio as gr

from layerswap.analysis.plots import layer_strips
from layerswap.core.errors import UserError
from layerswap.core.markup import code, text
from layerswap.ui.context import Context, Page
from layerswap.recipe.recipes import Recipe
from layerswap.recipe.sources import Sources
from layerswap.ui.controls import PlanControls, own_plans
from layerswap.ui.events import Job
from layerswap.ui.family import Loaded
from layerswap.ui.files import Budget
from layerswap.ui.visitors import FAMILY_FILES

PAIR = "pair"  # the menu's first entry: the pair loaded above
FAMILY_NAME, ZIP_DIR = FAMILY_FILES


def _loaded(v) -> Loaded:
    loaded = getattr(v, "family", None)
    if loaded is None:
        raise UserError("Load a family first: under Models write one CODE=REF line per language expert, then press "
                        "Load family.")
    return loaded


def chosen(v) -> str | None:
    """The language whose pair the analysis tab shows: a code of the visitor's family, or None (the pair above)."""
    loaded, c = getattr(v, "family", None), getattr(v, "family_lang", None)
    return c if loaded is not None and loaded.family.base and c in loaded.family.codes else None


def choose(v, value: object) -> None:
    """Keep the visitor's choice: the pair above, or one code of its loaded family (anything else refused)."""
    if value in (None, "", PAIR):
        v.family_lang = None
        return
    loaded = _loaded(v)
    if not isinstance(value, str) or value not in loaded.family.codes:
        raise UserError(f"Choose the pair above or one of the family's languages ({', '.join(loaded.family.codes)}).")
    if not loaded.family.base:
        raise UserError("A language's heatmaps compare its experts with their base: give the base above and press "
                        "Load family again.")
    v.family_lang = value


def menu(ctx: Context, job: Job):
    """The analysis tab's language menu for the visitor's family (the pair above first)."""
    v = job.visitor
    loaded = getattr(v, "family", None)
    members = loaded.family.members if loaded is not None else ()
    choices = [("the pair above", PAIR)] + [(f"{m.code}: {m.ref[:60]}", m.code) for m in members]
    return gr.update(choices=choices, value=chosen(v) or PAIR, visible=bool(members))


@contextlib.contextmanager
def opened(loaded: Loaded) -> Iterator[tuple]:
    """The family's base, math expert and language experts (code -> checkpoint), closed afterwards."""
    from layerswap.models.adapters import open_expert
    from layerswap.models.checkpoints import Checkpoint

    fam, cks = loaded.family, []
    try:
        base = Checkpoint.open(fam.base) if fam.base else None
        cks.append(base)
        math = open_expert(fam.math, fam.base)
        cks.append(math)
        langs = {}
        for m in fam.members:
            langs[m.code] = open_expert(m.ref, fam.base)
            cks.append(langs[m.code])
        yield base, math, langs
    finally:
        for ck in cks:
            if ck is not None:
                ck.close()


def _analyses(v, base, math, langs: dict, k: float | None, device: str, progress) -> dict:
    """Every language's `Analysis` (one `analyze_family` run), kept on the visitor for its family and ks."""
    from layerswap.analysis import analyze_family

    fam = v.family.family
    kept = getattr(v, "family_analyses", None)
    want = {1.0} | ({float(k)} if k is not None else set())
    if kept is not None and kept[0] == fam and want <= kept[1]:
        return kept[2]
    ks = want | (kept[1] if kept is not None and kept[0] == fam else set())
    out = analyze_family(base, math, langs, ks=sorted(ks), device=device, progress=progress)
    v.family_analyses = (fam, ks, out)
    return out


@contextlib.contextmanager
def pair_view(v, wb, k: float | None, progress=None) -> Iterator[tuple[object, Callable, str]]:
    """The analysis the tab shows, its merged model's stats for a plan, and a line naming the pair: the pair
    above (the workbench's), or the chosen language's of the family (call under the lane's lock)."""
    c = chosen(v)
    if c is None:
        yield wb.analysis(k, progress=progress), wb.merged_stats, ""
        return
    loaded = v.family
    with opened(loaded) as (base, math, langs):
        an = _analyses(v, base, math, langs, k, wb.analysis_device, progress)[c]
        device = wb.analysis_device

        def merged(plan):
            return an.merged(plan, math, langs[c], base, device=device)

        m = next(m for m in loaded.family.members if m.code == c)
        yield an, merged, f"**Language {c}:** the family's math expert and {code(m.ref)}.\n\n"


def overlay(v, plans, controls: PlanControls) -> Recipe:
    """The recipe the analysis tab draws on the heatmaps: the chosen language's own plan when the per-language plans
    give it one (`controls.own_plans`; a layer swap's, as the family's table takes them), else the page's."""
    c = chosen(v)
    return controls.for_language(own_plans(v.family.family, plans), c) if c is not None else controls.recipe


def plan_strips(ctx: Context, job: Job, plans, controls: PlanControls):
    """The layer sources of each language's merge in the visitor's family, a row per code (its own line or the
    page's plan: `PlanControls.for_language`, as the table, the export and the heatmaps take them); hidden without a
    family, and the mistake said in words while the lines or the controls are not a plan yet."""
    loaded = getattr(job.visitor, "family", None)
    if loaded is None:
        return gr.update(visible=False), ""
    fam, num_layers = loaded.family, loaded.check.num_layers
    try:
        own = own_plans(fam, plans)
        rs = {c: controls.for_language(own, c) for c in fam.codes}
        rows = {c: Sources(r, num_layers) for c, r in rs.items()}
    except UserError as e:
        return gr.update(visible=False), f"**Per-language plans:** {e}"
    said = "; ".join(f"{c}: {text(r.title())}" + (" (its own)" if r is not controls.recipe else "")
                     for c, r in rs.items())
    return gr.update(value=layer_strips(rows, num_layers), visible=True), f"Each language's merge: {said}."


def wire_strips(ctx: Context, page: Page, loaded, parts: dict) -> None:
    """The family's strips follow Load family, its plan lines and the page's plan controls (off the queue, as the
    Build tab's strip)."""
    show = dict(fn=ctx.job(plan_strips, clear_stop=False, plan=True), inputs=[page.family_plans, *page.plan],
                outputs=[parts["strip"], parts["strip_note"]], show_progress="hidden", queue=False)
    gr.on([x.change for x in (page.family_plans, *page.plan)], api_name="family_strip", trigger_mode="always_last",
          **show)
    loaded.success(api_visibility="private", **show)


def export_family(ctx: Context, job: Job, plans, controls: PlanControls):
    """One folder per language of the visitor's family in its own folder (replaced by each export), zipped."""
    from layerswap.merge.family_export import export_family as write

    v = job.visitor
    loaded = _loaded(v)
    fam = loaded.family
    own = own_plans(fam, plans)
    rs = {c: controls.for_language(own, c) for c in fam.codes}
    folder = ctx.shared.folder(v)
    for old in FAMILY_FILES:  # each export replaces the last
        shutil.rmtree(folder / old, ignore_errors=True)
    v.family_exported_at = 0.0
    ctx.shared.visitors.expire_exports()
    cap = ctx.policy.limits.zip_bytes
    with opened(loaded) as (base, math, langs):
        size = math.nbytes * len(langs)
        if ctx.policy.hosted:  # the visitors' disk budgets (locally, the export's own free-disk check)
            Budget(ctx.policy.limits).check(size + (size if size <= cap else 0), folder, ctx.shared.root,
                                            "this family's export")
        protect = tuple(p for p in (loaded.source,) if p)
        with ctx.shared.lock:
            done = write(math, langs, rs, folder / FAMILY_NAME, base=base, overwrite=True, force=loaded.force,
                         protect=protect, progress=lambda f, d: job.progress(0.9 * f, d))
    v.family_exported_at = time.monotonic()  # kept for the export TTL (`ui.visitors`)
    written = sum(p.stat().st_size for p in (folder / FAMILY_NAME).rglob("*") if p.is_file())
    plan = "".join(f"\n- **{c}**: {text(rs[c].title())}" + (" (its own plan)" if rs[c] is not controls.recipe else "")
                   for c in done)
    where = FAMILY_NAME if ctx.policy.hosted else f"`{folder / FAMILY_NAME}`"  # hosted: no server path
    msg = (f"Wrote {where}: {len(done)} merged models, one folder per language (weights, model card, "
           f"mergekit YAML), {written / 1e6:.1f} MB:{plan}")
    if written > cap:
        return msg + f"\n\nIt is over the {cap / 1e9:.1f} GB download cap.", gr.update(value=None, visible=False)
    job.progress(0.95, "zipping for download")
    (folder / ZIP_DIR).mkdir()
    path = shutil.make_archive(str(folder / ZIP_DIR / FAMILY_NAME), "zip", root_dir=folder / FAMILY_NAME)
    return msg, gr.update(value=path, visible=True)


def render_export(ctx: Context, page: Page) -> None:
    """The family's Export button, its status and download (under the family's table)."""
    with gr.Row():
        btn = gr.Button("Export the family (one folder per language)", elem_id="family-export", scale=1)
        download = gr.DownloadButton("Download the family (zip)", visible=False, elem_id="family-download", scale=1)
    status = gr.Markdown(elem_id="family-export-status")
    btn.click(ctx.job(export_family, plan=True, models=True), [page.family_plans, *page.plan, page.models],
              [status, download],
              api_name="export_family", **ctx.lane, **page.on)
