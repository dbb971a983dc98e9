"""What the package ships: `results` (an organism's measurements, `results.json`), `demo` (the demo organisms and
their measured plan), `organisms` (what shipped models bring: test sets, opening plans, banners).
"""
