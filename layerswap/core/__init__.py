"""Foundations every layer uses: `errors` (the one `UserError`), `runtime` (progress, cancellation, RAM), `jsonfile`
(bounded JSON reads), `bounds` (the bounds every value is read with), `scratch` (scratch folders), `roles`, `stats`
(exact intervals and paired tests), `markup` (escaping model text), `hardware` (GPUs, RAM, disk: one place a
setting can fake), `version`.
"""
