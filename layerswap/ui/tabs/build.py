"""The "Build & ask" tab: the plan controls and strip, Build, then the Ask, Export and Push sections.

Every event sends the visitor's own plan controls (`Page.plan`), read once into the event's `Recipe`
(`controls.PlanControls`, the handlers' last argument), so Ask, Export, Evaluate and the analysis always use that
visitor's plan; the shared merged model is rebuilt when it holds another one. The strip
previews the plan as the controls move (no merge); Build merges it at once.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import gradio as gr

from layerswap.merge.card import attach_eval
from layerswap.core.errors import UserError
from layerswap.merge.interop import mergekit_yaml
from layerswap.recipe.methods import METHODS
from layerswap.recipe.plans import KINDS, MODULES, NON_LAYER_OPTIONS
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import PlanControls, plan_inputs, query_string
from layerswap.ui.events import Job
from layerswap.ui.files import Budget
from layerswap.ui.tabs import ask, push, search

MAX_SLIDER = 64
EXPORT_NAME = "layerswap-merge"


def preview(ctx: Context, job: Job, controls: PlanControls):
    """Plan strip for the current controls (no merge); says whether the merged model holds it."""
    wb = ctx.shared.loaded(job.visitor.refs)
    if wb is None or "math" not in wb.checkpoints:
        return gr.update(), "Loading the models…"
    try:
        return ctx.strip_and_md(wb, controls, built=wb.holds(controls.recipe))
    except UserError as e:
        return None, f"**Invalid plan:** {e}"


def build(ctx: Context, job: Job, controls: PlanControls):
    wb, _ = ctx.built(job, controls)
    return [*ctx.strip_and_md(wb, controls, built=True), query_string(job.visitor.refs, controls.values)]


def export(ctx: Context, job: Job, out_dir: str, overwrite: bool, controls: PlanControls):
    return _export(ctx, job, out_dir, overwrite, controls, adapter=False)


def export_adapter(ctx: Context, job: Job, out_dir: str, overwrite: bool, controls: PlanControls):
    """The swap of two PEFT adapters of one kind, written as an adapter of that kind (`Workbench.export`)."""
    return _export(ctx, job, out_dir, overwrite, controls, adapter=True)


def _export(ctx: Context, job: Job, out_dir: str, overwrite: bool, controls: PlanControls, adapter: bool):
    v = job.visitor
    wb = ctx.workbench(job)
    kind = ctx.adapter_kind(v.refs)
    if adapter and kind is None:  # the button shows only for adapter experts; an API caller hears it in page terms
        raise UserError("Export as PEFT adapter needs two adapter experts of one kind (LoRA, IA3 or prefix tuning); "
                        "these are merged as full models: use Export merged model.")
    if not adapter and kind == "prefix":
        raise UserError("Prefix-tuning experts change no weight, so there is no full merged model to write: use "
                        "Export as PEFT adapter.")
    r = controls.recipe
    if ctx.policy.hosted:  # the visitor's own folder, replaced by each export, within the disk budgets
        own = ctx.shared.folder(v)
        for old in (EXPORT_NAME, "download"):
            shutil.rmtree(own / old, ignore_errors=True)
        v.last_export = None
        ctx.shared.visitors.expire_exports()
        size = wb.checkpoints["math"].nbytes
        need = size + (size if size <= ctx.policy.limits.zip_bytes else 0)  # the export, and its zip
        Budget(ctx.policy.limits).check(need, own, ctx.shared.root)
        out, overwrite = own / EXPORT_NAME, True
    else:
        out = (out_dir or "").strip()
        if not out:
            raise UserError("Give an output folder for the merged model.")
        out = Path(out).expanduser()
    with ctx.shared.lock:
        s = wb.export(out, recipe=r, overwrite=bool(overwrite), protect=tuple(p for p in (ctx.data(v.refs),) if p),
                      progress=job.progress, adapter=adapter)
    folder = s if adapter else s.out
    size = sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file()) if adapter else s.bytes_written
    v.last_export, v.exported_at = str(folder), time.monotonic()  # kept for the export TTL (`ui.visitors`)
    where = EXPORT_NAME if ctx.policy.hosted else f"`{folder}`"
    msg = (f"Wrote {where}: a {wb.checkpoints['math'].adapter_kind} adapter (PEFT) of the swap on the experts' base, "
           f"{size / 1e6:.2f} MB, with the tokenizer and model card." if adapter else
           f"Wrote {where}: {s.n_tensors} tensors ({s.n_copied} copied, {s.n_blended} computed), "
           f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard(s), with config, tokenizer and model card.")
    if v.last_eval is not None and v.eval_recipe == r.to_dict():
        attach_eval(folder, v.last_eval)  # the card shows what was measured on this very merge
        msg += " The card holds your evaluation of this plan (MGSM)."
    cap = ctx.policy.limits.zip_bytes
    zip_path = None
    if size <= cap:
        job.progress(0.95, "zipping for download")
        zdir = ctx.shared.folder(v) / "download"
        shutil.rmtree(zdir, ignore_errors=True)
        zdir.mkdir()
        zip_path = shutil.make_archive(str(zdir / EXPORT_NAME), "zip", root_dir=folder)
    else:
        msg += (f" It is over the {cap / 1e9:.1f} GB download cap: push it to the Hub instead."
                if ctx.policy.hosted else " (too large to offer as a download; copy it from the server.)")
    return msg, gr.update(value=zip_path, visible=zip_path is not None), gr.update(visible=True)


def export_yaml(ctx: Context, job: Job, controls: PlanControls):
    wb = ctx.workbench(job)
    text = ctx.policy.scrub(mergekit_yaml(wb.checkpoints["math"], wb.checkpoints["lang"], controls.recipe,
                                          wb.checkpoints.get("base")))
    path = ctx.shared.folder(job.visitor) / "layerswap-mergekit.yml"
    path.write_text(text)
    return gr.update(value=str(path), visible=True)


def yaml_written(ctx: Context, job: Job, controls: PlanControls) -> str:
    """The export status after the mergekit YAML: which plan it holds (the YAML button has its own file)."""
    wb = ctx.shared.loaded(job.visitor.refs)
    L = wb.num_layers if wb is not None else None
    title = controls.recipe.title() + (f", {L} layers" if L else "")
    return (f"Wrote the mergekit YAML of {title}: **Download mergekit YAML** below. `mergekit-yaml` builds the same "
            "merge from it (experts named as loaded here).")


def _plan_controls(ctx: Context, page: Page) -> gr.Button:
    p0 = ctx.plan0
    gr.Markdown("### 2 · Plan (built automatically when you ask, evaluate or analyse)")
    with gr.Row():
        page.sliders = [gr.Slider(0, MAX_SLIDER, getattr(p0, k), step=1, label=label, elem_id=k) for k, label in (
            ("b", "b: bottom layers from language expert"), ("u", "u: top layers from language expert"),
            ("tb", "tb: bottom transition layers"), ("tu", "tu: top transition layers"))]
    with gr.Row():
        transition = gr.Radio(["flat", "ramp"], value=p0.transition, label="Transition weights",
                              info="flat: one weight; ramp: linear steps between the experts", elem_id="transition")
        tw = gr.Slider(0, 1, p0.transition_weight, step=0.05, label="Flat transition weight (language share)",
                       elem_id="tw")
        non_layer = gr.Dropdown(list(NON_LAYER_OPTIONS), value=p0.non_layer, label="Embeddings, final norm, lm_head",
                                elem_id="non-layer-src",
                                info="neighbour: embeddings follow layer 0, norm and lm_head the last layer")
    with gr.Accordion("Other layer maps (ablations) and baseline methods", open=False):
        with gr.Row():
            kind = gr.Radio(list(KINDS), value="swap", label="Layer map", elem_id="kind",
                            info="swap uses b/u/tb/tu; middle/random use k; weights uses the list")
            modules = gr.Radio(list(MODULES), value="all", label="Modules", elem_id="modules",
                               info="apply the map to attention or MLP only")
        with gr.Row():
            map_k = gr.Slider(0, MAX_SLIDER, 4, step=1, label="k: layers from the language expert")
            seed = gr.Number(0, precision=0, label="Seed (random map, DARE)")
            offset = gr.Radio([0, 1], value=0, label="Alternating: first language layer")
        with gr.Row():
            layer_weights = gr.Textbox("", label="Per-layer language weights (comma-separated, one per layer)")
            revert = gr.Textbox("", label="Revert layers to the base (e.g. 3-4,7; needs the base)",
                                info="their fine-tuning undone: every tensor from the base", elem_id="revert")
        with gr.Row():
            method = gr.Dropdown(list(METHODS), value="layer_swap", label="Merge method",
                                 info="layer_swap uses the map; the others are the paper's baselines", elem_id="method")
            weight = gr.Slider(0, 1, 0.5, step=0.05, label="Soup: language share")
            lam = gr.Number(1.0, label="Task-vector scale (lambda)")
            density = gr.Slider(0.01, 1, 0.2, step=0.01, label="TIES density")
            drop_rate = gr.Slider(0, 0.99, 0.9, step=0.01, label="DARE drop rate")
            expert_weights = gr.Textbox("1,1", label="Task arithmetic: expert weights (math, language)")
    b, u, tb, tu = page.sliders
    page.plan = plan_inputs(b=b, u=u, tb=tb, tu=tu, transition=transition, tw=tw, non_layer=non_layer, kind=kind,
                            weights=layer_weights, k=map_k, seed=seed, offset=offset, modules=modules, method=method,
                            weight=weight, lam=lam, density=density, drop_rate=drop_rate,
                            expert_weights=expert_weights, revert=revert)  # in the table's order
    with gr.Row():
        build_btn = gr.Button("Build merge now", variant="primary", elem_id="build")
        page.share = gr.Textbox(label="Share this view (append to the page address)", elem_id="share",
                                interactive=False, buttons=["copy"], scale=3)
    page.strip = gr.Plot(label="Layer sources", elem_id="strip")
    page.plan_md = gr.Markdown(elem_id="plan")
    return build_btn


def render(ctx: Context, page: Page) -> None:
    pol = ctx.policy
    with gr.Tab("Build & ask", id="build", elem_id="tab-build") as page.tab_items["build"]:
        with gr.Group():
            build_btn = _plan_controls(ctx, page)
        search.render(ctx, page)
        ask.render(ctx, page)
        with gr.Group():
            gr.Markdown("### 4 · Export")
            with gr.Row():
                out_dir = gr.Textbox(str(Path("~") / "layerswap-exports" / EXPORT_NAME),  # outside any checkout
                                     label="Output folder (on the server)",
                                     scale=3, visible=not pol.hosted, elem_id="out-dir")
                overwrite = gr.Checkbox(False, label="Overwrite an earlier export", visible=not pol.hosted)
            with gr.Row():
                export_btn = gr.Button("Export merged model", elem_id="export")
                adapter_btn = gr.Button("Export as PEFT adapter", elem_id="export-adapter",  # adapter experts only
                                        visible=ctx.adapter_kind(ctx.key) is not None)
                yaml_btn = gr.Button("mergekit YAML", elem_id="export-yaml")
            export_md = gr.Markdown(elem_id="export-status")
            with gr.Row():
                download = gr.DownloadButton("Download .zip", visible=False, elem_id="download")
                yaml_file = gr.DownloadButton("Download mergekit YAML", visible=False, elem_id="yaml-file")
        push.render(ctx, page)
    page.on_models([adapter_btn], lambda c, refs: [gr.update(visible=c.adapter_kind(refs) is not None)])

    quick = dict(clear_stop=False)
    # preview skips the queue, so a Build queued after it always has the last word
    gr.on([c.change for c in page.plan], ctx.job(preview, **quick, plan=True), page.plan, [page.strip, page.plan_md],
          api_name="preview", trigger_mode="always_last", show_progress="hidden", queue=False)
    page.redraw(build_btn.click(ctx.job(build, plan=True, models=True), [*page.plan, page.models], [page.strip, page.plan_md, page.share], api_name="build",
                                **ctx.lane, **page.on))
    export_btn.click(ctx.job(export, plan=True, models=True), [out_dir, overwrite, *page.plan, page.models], [export_md, download, page.push_group],
                     api_name="export", **ctx.lane, **page.on)
    adapter_btn.click(ctx.job(export_adapter, plan=True, models=True), [out_dir, overwrite, *page.plan, page.models],
                      [export_md, download, page.push_group], api_name="export_adapter", **ctx.lane, **page.on)
    yaml_btn.click(ctx.job(export_yaml, plan=True, models=True), [*page.plan, page.models], [yaml_file],
                   api_name="export_yaml", **ctx.lane, **page.on).success(
        ctx.job(yaml_written, clear_stop=False, plan=True), page.plan, [export_md], queue=False, api_visibility="private")
