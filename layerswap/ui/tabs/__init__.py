"""The page's parts, one module each: the Models section and the Build, Analysis, Evaluate and Sweeps tabs.

Each module keeps its handlers (``handler(ctx, job, *values)``; a plan event's last argument is the plan controls
read once, `controls.PlanControls`) next to the `.click` that wires them.
"""
