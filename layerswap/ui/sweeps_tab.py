"""The app's Sweeps tab: run, watch, stop and resume a sweep file, with its table and plots.

A mixin of `layerswap.ui.app.App`; it only calls the library (`sweeps.spec`, `sweeps.run_sweep`,
`sweeps.report`). The shipped ablations (`assets/sweeps/*.yaml`) are offered by name; locally any
sweep file path works too. Each finished point is appended to the results file at once, so Stop
(between batches) loses nothing and Run again resumes where it stopped. In hosted mode only the
shipped files run, within the sweep-size cap, and results go to the visitor's own folder.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from ..errors import UserError
from ..presets import assets_dir
from .analysis_tab import TabIO
from .events import guarded
from .session import cancellable


def shipped_sweeps() -> dict[str, Path]:
    """The shipped sweep files by file name."""
    d = assets_dir() / "sweeps"
    return {p.name: p for p in sorted(d.glob("*.yaml"))} if d.is_dir() else {}


class SweepsTab:
    """Sweeps-tab events and layout; mixed into `App`."""

    def _sweep_paths(self, v, name: str, custom: str, results: str) -> tuple[Path, Path]:
        custom = (custom or "").strip()
        if custom:
            if self.policy.hosted:
                raise UserError("This server runs the shipped sweep files only; pick one from the list.")
            spec_path = Path(custom).expanduser()
            if not spec_path.is_file():
                raise UserError(f"{custom}: no such sweep file.")
        else:
            spec_path = shipped_sweeps().get(name or "")
            if spec_path is None:
                raise UserError("Pick a sweep file.")
        if self.policy.hosted or not (results or "").strip():
            out = self.shared.folder(v.sid) / "sweeps" / f"{spec_path.stem}.jsonl"
        else:
            out = Path(results.strip()).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        return spec_path, out

    def run_sweep(self, v, name, custom, results, limit, request: gr.Request = None, progress=gr.Progress()):
        from ..outputs import check_output_file, input_paths
        from ..sweeps import load_spec, run_sweep, with_eval

        v = self.visitor(v, request)
        spec_path, out = self._sweep_paths(v, name, custom, results)
        spec = with_eval(load_spec(spec_path), limit=int(limit) if limit else None)
        if self.policy.hosted:
            if len(spec.points) > self.policy.limits.sweep_points:
                raise UserError(f"This sweep has {len(spec.points)} recipes; this server runs up to "
                                f"{self.policy.limits.sweep_points}.")
            self.policy.check_eval(spec.eval.get("limit"), largest_set=10**9)  # no limit: whole sets, refused
        check_output_file(out, input_paths(extra=[r for es in spec.expert_sets for r in es.refs().values()]))
        flag = self.shared.cancel_flag(v.sid)
        flag.clear()
        with self.shared.lock:  # one lane: a sweep holds the models' place in the queue
            run = run_sweep(spec, out, progress=cancellable(lambda f, d: progress(f, desc=d), flag), cancel=flag)
        return self._sweep_view(run.rows, spec.name, out, run.cancelled, run.ran)

    def show_sweep(self, v, name, custom, results, limit, request: gr.Request = None):
        """The results file as it is now (a running sweep's or an earlier run's), without running anything."""
        from ..sweeps import load_spec, sweep_results, with_eval

        v = self.visitor(v, request)
        spec_path, out = self._sweep_paths(v, name, custom, results)
        spec = with_eval(load_spec(spec_path), limit=int(limit) if limit else None)
        rows = sweep_results(spec, out) if out.exists() else []
        return self._sweep_view(rows, spec.name, out, None, 0)

    def _sweep_view(self, rows, title: str, out: Path, cancelled, ran: int):
        from ..sweeps.report import results_table, sweep_figures, write_csv, write_html

        table = results_table(rows)
        state = "stopped (Run again resumes)" if cancelled else "finished" if cancelled is not None else "so far"
        status = f"**{title}:** {len(table)} points in the results file, {ran} computed now, {state}."
        if not table:
            return [status + " Press Run.", gr.update(visible=False)] + [gr.update(visible=False)] * 4
        figs = [f for _, f in sweep_figures(rows)][:3]
        csv_path, html_path = out.with_suffix(".csv"), out.with_suffix(".html")
        write_csv(rows, csv_path)
        write_html(rows, html_path, title=title)
        plots = [gr.update(value=f, visible=True) for f in figs] + [gr.update(visible=False)] * (3 - len(figs))
        import pandas as pd

        return [status, gr.update(value=pd.DataFrame(table), visible=True), *plots,
                gr.update(value=[str(csv_path), str(html_path)], visible=True)]

    def _sweeps_tab(self) -> TabIO:
        files = list(shipped_sweeps())
        with gr.Tab("Sweeps", id="sweeps", elem_id="tab-sweeps"):
            gr.Markdown("### Sweeps: many recipes, evaluated and compared\nA sweep file lists experts, recipes (or "
                        "a grid) and test sets (`assets/sweeps/README.md`). Each finished point is written at once: "
                        "Stop keeps it, and Run again resumes. The same file runs from the command line: "
                        "`layerswap sweep FILE -o results.jsonl`.")
            with gr.Row():
                name = gr.Dropdown(files, value=files[0] if files else None, label="Shipped sweep", elem_id="sweep-file")
                custom = gr.Textbox(label="…or a sweep file on this machine", visible=not self.policy.hosted)
                results = gr.Textbox(label="Results file (default: a file of your own session)",
                                     visible=not self.policy.hosted)
                limit = gr.Number(10, precision=0, minimum=0, label="Questions per language (0 = the file's setting)")
            with gr.Row():
                run = gr.Button("Run / resume", variant="primary", elem_id="sweep-run")
                show = gr.Button("Show results so far", elem_id="sweep-show")
                stop = gr.Button("Stop", variant="stop", elem_id="sweep-stop")
            status = gr.Markdown("Pick a sweep and press Run.", elem_id="sweep-status")
            table = gr.Dataframe(label="Accuracy (%) per point, ± standard error", visible=False, interactive=False,
                                 elem_id="sweep-table")
            plots = [gr.Plot(visible=False, elem_id=f"sweep-plot-{i}") for i in range(3)]
            files_out = gr.File(label="Results as CSV and HTML", file_count="multiple", visible=False)
        return TabIO([name, custom, results, limit], [status, table, *plots, files_out],
                     {"run": run, "show": show, "stop": stop})

    def _wire_sweeps(self, io: TabIO, visitor, lane: dict) -> None:
        status = io.outputs[0]
        io.extra["run"].click(self.event(self.run_sweep), [visitor, *io.inputs], io.outputs, api_name="sweep", **lane,
                              show_progress_on=[status])
        io.extra["show"].click(guarded(self.show_sweep, self.policy), [visitor, *io.inputs], io.outputs,
                               api_name="sweep_results", concurrency_limit=None)
        io.extra["stop"].click(self.stop, [visitor], [status], api_name="stop_sweep", queue=False)
