"""The page's parts, one module each: the Models section and the Build, Analysis, Evaluate and Sweeps tabs.

Each module keeps its handlers (``handler(ctx, job, *values)``) next to the `.click` that wires them.
"""
