"""Starting the app: its flags (shared by `python app.py` and `layerswap app`), the default models, launch."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from layerswap.engines import EngineSettings
from layerswap.serving.hosting import Limits


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The app's flags; each defaults to its LAYERSWAP_* environment variable (how a Space configures it)."""
    env = os.environ.get
    p.add_argument("--math", default=env("LAYERSWAP_MATH"), help="math expert (folder or Hub id)")
    p.add_argument("--lang", default=env("LAYERSWAP_LANG"), help="language expert (folder or Hub id)")
    p.add_argument("--base", default=env("LAYERSWAP_BASE"), help="base model (for heatmaps)")
    p.add_argument("--mgsm-dir", default=env("LAYERSWAP_MGSM_DIR"),
                   help="folder of mgsm_XX.tsv files for models that bring no test set of their own (the shipped "
                        "organisms use theirs; default: the Hub)")
    EngineSettings.add_arguments(p.add_argument_group("engine"))  # the CLI commands' engine flags
    p.add_argument("--host", default=env("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("GRADIO_SERVER_PORT", "7860")))
    p.add_argument("--share", action="store_true", help="public gradio.live link (needs internet)")
    p.add_argument("--max-models", type=int, default=int(env("LAYERSWAP_MAX_MODELS", "1")),
                   help="model trios held at once for all visitors (default 1; more need more memory)")
    p.add_argument("--max-visitors", type=int, default=int(env("LAYERSWAP_MAX_VISITORS", str(Limits.visitors))),
                   help=f"sessions remembered at once (default {Limits.visitors}); a visitor with work in progress "
                        "is never dropped")
    p.add_argument("--max-queue", type=int, default=int(env("LAYERSWAP_MAX_QUEUE", "0")),
                   help="jobs waiting in the queue before new ones are refused (default 0: one per remembered "
                        "visitor and 16 more, so that with one job per visitor the queue is never full)")


def run(args: argparse.Namespace) -> int:
    """Serve the page at once on the given models (or the shipped demo organism); they load behind it."""
    from layerswap.shipped.demo import demo_refs
    from layerswap.serving.hosting import Policy, forbid_implicit_token, gpu_mode
    from layerswap.ui.app import create_app
    from layerswap.ui.lane import queue_size

    from layerswap.core.scratch import clean_stale

    from layerswap.ui.files import files_base

    from layerswap.engines.vllm_engine import fix_start_method
    from layerswap.core.hardware import startup_report

    fix_start_method()  # before anything can touch CUDA: engines are spawned, whatever ran first

    for line in startup_report():  # driver and CUDA versions; a GPU torch does not see is said, not hidden
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout, flush=True)
    for d in clean_stale() + clean_stale(files_base()):  # scratch merges and visitor folders of a killed run
        print(f"removed a stale scratch folder: {d}")
    policy = Policy.from_env()
    if policy.hosted:
        forbid_implicit_token()
    gpu = gpu_mode()
    label = ""
    if not (args.math and args.lang):
        print("No --math/--lang given: starting on the demo models (built offline on first run).")
        refs, label, _, _ = demo_refs()  # their MGSM set and plan come with them (`organisms`)
        args.math, args.lang, args.base = refs["math"], refs["lang"], refs["base"]
    if gpu == "zerogpu":  # the page is served, answers off with the hardware to pick (the engine plan says it too)
        print(zero_gpu_refusal(args.math, args.lang), file=sys.stderr, flush=True)
        args.device = "cpu"  # the main process has no GPU there: merges, analysis and lens run on the CPU
    demo, app = create_app(app_defaults(args, label=label, policy=policy, gpu=gpu))
    print(f"serving the page now; {'hosted mode, ' if policy.hosted else ''}GPU mode: {gpu}; models load in the "
          "background", flush=True)
    # vLLM engines run in child processes: on SIGTERM exit normally so that they are shut down too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        demo.queue(default_concurrency_limit=1, max_size=args.max_queue or queue_size(app.shared)).launch(
            server_name=args.host, server_port=args.port, share=args.share, prevent_thread_lock=True,
            show_error=True, state_session_capacity=args.max_visitors)  # show_error: Gradio's own refusals (a
        # value of the wrong type for a slider, say) readable too instead of a bare "Error"
        app.shared.visitors.bound_state(demo)  # Gradio's per-session state: as many, never a busy visitor's
        app.start_loading()  # after the page is served: model imports and loads never delay it
        demo.block_thread()
    finally:
        app.shared.close()
    return 0


def app_defaults(args: argparse.Namespace, *, label: str = "", policy=None, gpu: str = "cpu"):
    """What the page starts with, from the app's flags (the engine flags as `EngineSettings.from_args`)."""
    from layerswap.serving.hosting import Policy
    from layerswap.ui.app import AppDefaults

    return AppDefaults(math=args.math, lang=args.lang, base=args.base or "", label=label, mgsm_dir=args.mgsm_dir,
                       engine=EngineSettings.from_args(args, chat_template=None), policy=policy or Policy(),
                       capacity=args.max_models, gpu=gpu, max_visitors=args.max_visitors)


def zero_gpu_refusal(math: str, lang: str) -> str:
    """Why the app answers nothing on ZeroGPU, and which Spaces hardware serves these models instead (the engine
    plan over the Hub's flavours, from the headers of local or shipped models; the literature's 8B trio otherwise)."""
    from layerswap.engines.planning import zero_gpu_problem, would_serve_text
    from layerswap.models.hub import hub_id_of

    pick = ("`a100-large` (three vLLM engines) or `l40sx1` (two) for 8B experts; `layerswap inspect --math M --lang L "
            "--hardware all` says which serves yours")
    if not (hub_id_of(math) or hub_id_of(lang)):
        from layerswap.models.checkpoints import Checkpoint

        try:
            pick = would_serve_text({"math": Checkpoint.open(math), "lang": Checkpoint.open(lang)})
        except Exception:  # unreadable models: the generic advice stands
            pass
    return (f"Answers are off on ZeroGPU: {zero_gpu_problem()} The report, heatmaps, lens and export work. For "
            f"answers, pick this hardware in the Space's settings: {pick}. See docs/hosting.md#what-serves-which-models.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="app.py", description="layerswap: merge two experts by layer swapping, in the browser.")
    add_arguments(p)
    return run(p.parse_args(argv))
