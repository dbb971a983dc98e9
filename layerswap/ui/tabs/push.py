"""The Push to Hub section of the Build tab: keep a merge by uploading the visitor's export to the visitor's repo.

It only calls `layerswap.merge.publish.push`. The token is always the visitor's own: on a Space, the page's Hugging
Face login (`gr.LoginButton`, OAuth); on another hosted server, a token field the visitor fills (empty is
refused); locally, the token field or, empty, this machine's login (the user's own). The server's token is
never used for a visitor (off Spaces, Gradio's login button would stand in the server's own login, so it is
not offered there). Stop my job cancels between files, before the commit.
"""

from __future__ import annotations

import gradio as gr

from layerswap.core.errors import UserError
from layerswap.serving.hosting import on_space
from layerswap.merge.publish import LOGIN_FIRST
from layerswap.ui.context import Context, Page
from layerswap.ui.events import Job


def push(ctx: Context, job: Job, repo_id: str, private: bool, token_text: str = "",
         oauth_token: gr.OAuthToken | None = None) -> str:
    from layerswap.merge.publish import push as push_folder

    v = job.visitor
    if not v.last_export:
        raise UserError("Export the merged model first (button above); the export is what gets pushed.")
    if ctx.policy.hosted:
        if on_space():  # the page's login only: a pasted token is ignored there
            token = oauth_token.token if oauth_token is not None else None
        else:
            token = str(token_text or "").strip()[:1000]
        if not token:
            raise UserError(LOGIN_FIRST if on_space() else "Give your own Hub token (write access) to push.")
        ambient = False
    else:
        token = str(token_text or "").strip() or None
        ambient = token is None  # the user's own machine: its login is the user's
    job.progress(0, "comparing with the repo")
    r = push_folder(v.last_export, str(repo_id or "").strip()[:200], token=token, allow_ambient_token=ambient,
                    private=bool(private), cancel=v.stop, progress=job.progress)
    return (f"Pushed to [{r.repo_id}]({r.url}): {len(r.uploaded)} files uploaded ({r.bytes_sent / 1e6:.1f} MB), "
            f"{len(r.unchanged)} unchanged.")


def render(ctx: Context, page: Page) -> None:
    pol = ctx.policy
    with gr.Group(visible=False) as page.push_group:
        gr.Markdown("### 5 · Keep it: push the export to your own Hugging Face repo")
        with gr.Row():
            if pol.hosted and on_space():
                gr.LoginButton()
            repo = gr.Textbox(label="Repo id (yours)", placeholder="your-name/layerswap-merge", elem_id="push-repo",
                              scale=3)
            private = gr.Checkbox(True, label="Private")
        token = gr.Textbox(label="Hub token with write access" + ("" if pol.hosted else " (empty: this machine's login)"),
                           type="password", elem_id="push-token", visible=not (pol.hosted and on_space()))
        btn = gr.Button("Push to Hub", elem_id="push")
        status = gr.Markdown(elem_id="push-status")
    btn.click(ctx.job(push), [repo, private, token], [status],
              api_name="push", **ctx.lane, show_progress_on=[status]).failure(
        lambda: "", None, [status], queue=False, api_visibility="private")  # the dialog says why: no bare "Error" here
