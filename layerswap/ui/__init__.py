"""The Gradio app, which only calls the library: `app` (the page and its events), `evaluate` (the
Evaluate tab), `events` (errors shown with their fix), `launch` (flags, default models, serving).

Nothing is imported here, so `layerswap.ui.launch` (the CLI's `app` flags) loads without gradio.
"""
