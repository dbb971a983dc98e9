"""MGSM as one task: `mgsm` (data, prompts, shots, modes, scoring, aligned with lm-evaluation-harness `mgsm_*`) and
`run` (batched, cancellable evaluation runs on any engine).
"""
