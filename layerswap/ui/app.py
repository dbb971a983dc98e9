"""The Gradio page: a title, the Models section, and the tabs, each a module of `layerswap.ui.tabs`.

Every part only calls the library through the shared `Context` (`ui.context`): each visitor's events carry that
visitor's own plan controls, and identity comes from the server's session (`ui.events`). Models are shared between
visitors who use the same trio and run one job at a time (`session.Shared`). The page is served at once; the
default models load behind a visible status, and the current plan is built whenever a tab needs it. In hosted
mode (`layerswap.serving.hosting`) visitors name models by Hub id or preset only, exports go to the visitor's own folder,
and no server path is shown.
"""

from __future__ import annotations

import os

import gradio as gr

from layerswap.shipped.demo import card_markdown
from layerswap.ui.context import AppDefaults, Context, Page
from layerswap.ui.session import Shared
from layerswap.ui.tabs import analysis, build, evaluate, models, sweeps

__all__ = ["AppDefaults", "Context", "create_app"]


def _banner(ctx: Context, refs) -> list:
    """The banner and the organism card of the visitor's models (`Context.banner`)."""
    md, card = ctx.banner(refs)
    return [md, gr.update(visible=card is not None), card_markdown(card) if card is not None else ""]


def _header(ctx: Context, page: Page) -> None:
    d, pol = ctx.d, ctx.policy
    gr.Markdown("# layerswap\nMerge a **math expert** and a **language expert** fine-tuned from one base by layer "
                "swapping (Bandarkar et al., ICLR 2025): the bottom *b* and top *u* layers come from the language "
                "expert, the middle from the math expert, with *tb*/*tu* blended transition layers.")
    md, card = ctx.banner(ctx.key) if d.math and d.lang else ("", None)
    banner = gr.Markdown(md, elem_id="demo-label")
    with gr.Accordion("The organism's card: how it was built, every number, its limits", open=False,
                      elem_id="organism-card", visible=card is not None) as accordion:
        text = gr.Markdown(card_markdown(card) if card is not None else "", elem_id="card-text")
    page.on_models([banner, accordion, text], lambda c, refs: _banner(c, refs))
    if pol.hosted:
        gr.Markdown(f"> **Hosted mode** ({d.gpu} GPU mode):  models by Hub id (public, no token) or preset only; "
                    f"exports stay in your own temporary folder. Limits: {pol.limits.markdown()}.", elem_id="hosted")


def create_app(defaults: AppDefaults, shared: Shared | None = None) -> tuple[gr.Blocks, Context]:
    """The page; `Context.start_loading` then loads the default models in the background."""
    ctx = Context(defaults, shared)
    page = Page()
    with gr.Blocks(title="layerswap", delete_cache=(3600, 3600)) as demo:
        _header(ctx, page)
        page.status = gr.Markdown(ctx.shared.status, elem_id="status")
        section = models.render(ctx, page)
        page.tab = gr.State("build")  # the visitor's open tab, for the share link
        with gr.Tabs(elem_id="main-tabs") as page.tabs:
            build.render(ctx, page)
            analysis.render(ctx, page)
            evaluate.render(ctx, page)
            sweeps.render(ctx, page)
        models.wire(ctx, page, demo, section)
    # an admission lapses once Gradio holds no event of its session (the client went away before it ran)
    ctx.fair.pending = lambda session: bool(demo._queue.pending_event_ids_session.get(session))
    return demo, ctx


os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
