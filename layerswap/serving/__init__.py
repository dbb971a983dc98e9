"""The session behind the app, `ask` and `eval`: `answering` (the engines of one trio started from their plan, swapped
and released), `workbench` (`Workbench`: check, build, ask, evaluate, analyse, export), `hosting` (the hosted
policy: caps, allowed models, path scrubbing).
"""
