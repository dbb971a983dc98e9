"""Sweeps: many recipes merged and evaluated, resumable, on one machine or on Ray actors; tables and figures.

    from layerswap.sweeps import run_sweep, sweep_results, load_results
    run = run_sweep("assets/sweeps/1-counts.yaml", "results.jsonl", progress=print)
    rows = load_results("results.jsonl")          # also while a sweep runs, or after it was killed

Where each part lives (each module imports only those above it):

    spec      sweep files: experts, recipes or grid, test sets, settings (SweepSpec, load_spec)
    points    the (b, u, t) grid of swap plans and the ablation suite (swap_grid, ablation_suite)
    log       the append-only, fsynced results file (ResultsLog, load_results, point_key)
    records   what each record measures (its key), the units of work, every kind of record
    loop      the one evaluation step of sweeps and search: build, evaluate, record (measure)
    run       the resumable runner (run_sweep, sweep_results)
    ray       the one Ray runner, workers with their GPUs (Pool, actor_options; run_sweep_ray; pip install ray)
    inmemory  points evaluated with a loaded workbench, nothing on disk (evaluate_points)
    report    tables with standard errors, figures, CSV and HTML, from the records (imports plotly)
"""

from layerswap.sweeps.inmemory import SweepResult, SweepRow, evaluate_points
from layerswap.sweeps import loop
from layerswap.sweeps.log import ResultsLog, load_results, point_key
from layerswap.sweeps.points import ablation_suite, swap_grid
from layerswap.sweeps.run import SweepRun, run_sweep, sweep_results
from layerswap.sweeps.spec import ExpertSet, SweepPoint, SweepSpec, TestSet, load_spec, with_eval

__all__ = [
    "ExpertSet", "ResultsLog", "SweepPoint", "SweepResult", "SweepRow", "SweepRun", "SweepSpec", "TestSet",
    "ablation_suite", "evaluate_points", "load_results", "load_spec", "loop", "point_key", "run_sweep", "swap_grid",
    "sweep_results", "with_eval",
]
