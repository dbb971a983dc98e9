"""The Sweeps tab: run, watch, stop and resume a sweep file, with its table and plots.

It only calls the library (`sweeps.spec`, `sweeps.run_sweep`, `sweeps.report`). The shipped ablations
(`assets/sweeps/*.yaml`) are offered by name; locally any sweep file path works too. Each finished point is
appended to the results file at once, so Stop (between batches) loses nothing and Run again resumes where it
stopped. In hosted mode only the shipped files run, within `Policy.check_sweep`, and results go to the
visitor's own folder.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from layerswap.core.errors import UserError, whole_number
from layerswap.models.presets import assets_dir
from layerswap.ui.context import Context, Page
from layerswap.ui.events import Job
from layerswap.ui.tabs.models import stop


def shipped_sweeps() -> dict[str, Path]:
    """The shipped sweep files by file name."""
    d = assets_dir() / "sweeps"
    return {p.name: p for p in sorted(d.glob("*.yaml"))} if d.is_dir() else {}


def _spec(ctx: Context, job: Job, name: str, custom: str, results: str, limit):
    """The sweep file (with the question limit), and the results file: the visitor's own unless a local path."""
    from layerswap.sweeps import load_spec, with_eval

    custom = str(custom or "").strip()
    if custom:
        if ctx.policy.hosted:
            raise UserError("This server runs the shipped sweep files only; pick one from the list.")
        spec_path = Path(custom).expanduser()
        if not spec_path.is_file():
            raise UserError(f"{custom}: no such sweep file.")
    else:
        spec_path = shipped_sweeps().get(name or "")
        if spec_path is None:
            raise UserError("Pick a sweep file.")
    if ctx.policy.hosted or not str(results or "").strip():
        out = ctx.shared.folder(job.visitor) / "sweeps" / f"{spec_path.stem}.jsonl"
    else:
        out = Path(str(results).strip()).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = with_eval(load_spec(spec_path), limit=whole_number(limit or 0, "Questions per language", 0, 10**6) or None)
    return spec, out


def run_sweep(ctx: Context, job: Job, name, custom, results, limit):
    from layerswap.merge.outputs import check_output_file, input_paths
    from layerswap.sweeps import run_sweep as run

    spec, out = _spec(ctx, job, name, custom, results, limit)
    ctx.policy.check_sweep(spec.evaluations(), spec.eval.get("limit"))
    check_output_file(out, input_paths(extra=[r for es in spec.expert_sets for r in es.refs().values()]))
    with ctx.shared.lock:  # one lane: a sweep holds the models' place in the queue
        # the sweep's own progress: points, what loads, an ETA from measured points (not the job's elapsed time)
        done = run(spec, out, progress=lambda f, d: job.bar(f, desc=d), cancel=job.visitor.stop)
    return _view(done.rows, spec.name, out, done.cancelled, done.ran)


def show_sweep(ctx: Context, job: Job, name, custom, results, limit):
    """The results file as it is now (a running sweep's or an earlier run's), without running anything."""
    from layerswap.sweeps import sweep_results

    spec, out = _spec(ctx, job, name, custom, results, limit)
    return _view(sweep_results(spec, out) if out.exists() else [], spec.name, out, None, 0)


def _view(rows, title: str, out: Path, cancelled, ran: int):
    import pandas as pd

    from layerswap.sweeps.report import family_table, results_table, sweep_figures, write_csv, write_html

    # a family's points as the paper's table (a column per language), then any others (e.g. points not run)
    points = results_table(rows)
    table = family_table(rows) + [r for r in points if not r.get("family")]
    state = "stopped (Run again resumes)" if cancelled else "finished" if cancelled is not None else "so far"
    status = f"**{title}:** {len(points)} points in the results file, {ran} computed now, {state}."
    if not table:
        return [status + " Press Run.", gr.update(visible=False)] + [gr.update(visible=False)] * 4
    figs = [f for _, f in sweep_figures(rows)][:3]
    csv_path, html_path = out.with_suffix(".csv"), out.with_suffix(".html")
    write_csv(rows, csv_path)
    write_html(rows, html_path, title=title)
    plots = [gr.update(value=f, visible=True) for f in figs] + [gr.update(visible=False)] * (3 - len(figs))
    return [status, gr.update(value=pd.DataFrame(table), visible=True), *plots,
            gr.update(value=[str(csv_path), str(html_path)], visible=True)]


def render(ctx: Context, page: Page) -> None:
    files = list(shipped_sweeps())
    with gr.Tab("Sweeps", id="sweeps", elem_id="tab-sweeps") as page.tab_items["sweeps"]:
        gr.Markdown("### Sweeps: many recipes, evaluated and compared\nA sweep file lists experts, recipes (or "
                    "a grid) and test sets (`assets/sweeps/README.md`). Each finished point is written at once: "
                    "Stop keeps it, and Run again resumes. The same file runs from the command line: "
                    "`layerswap sweep FILE -o results.jsonl`.")
        with gr.Row():
            name = gr.Dropdown(files, value=files[0] if files else None, label="Shipped sweep", elem_id="sweep-file")
            custom = gr.Textbox(label="…or a sweep file on this machine", visible=not ctx.policy.hosted)
            results = gr.Textbox(label="Results file (default: a file of your own session)",
                                 visible=not ctx.policy.hosted)
            limit = gr.Number(10, precision=0, minimum=0, label="Questions per language (0 = the file's setting)")
        with gr.Row():
            run_btn = gr.Button("Run / resume", variant="primary", elem_id="sweep-run")
            show_btn = gr.Button("Show results so far", elem_id="sweep-show")
            stop_btn = gr.Button("Stop", variant="stop", elem_id="sweep-stop")
        status = gr.Markdown("Pick a sweep and press Run.", elem_id="sweep-status")
        table = gr.Dataframe(label="Accuracy (%) per point, ± standard error", visible=False, interactive=False,
                             elem_id="sweep-table")
        plots = [gr.Plot(visible=False, elem_id=f"sweep-plot-{i}") for i in range(3)]
        files_out = gr.File(label="Results as CSV and HTML", file_count="multiple", visible=False)
    inputs, outputs = [name, custom, results, limit], [status, table, *plots, files_out]
    quick = dict(clear_stop=False)
    run_btn.click(ctx.job(run_sweep), inputs, outputs, api_name="sweep", **ctx.lane, show_progress_on=[status])
    show_btn.click(ctx.job(show_sweep, **quick), inputs, outputs, api_name="sweep_results", queue=False)
    stop_btn.click(ctx.job(stop, **quick), None, [status], api_name="stop_sweep", queue=False)
