"""Models on disk: `tensorfile` (the one safetensors reader and writer), `architectures`, `hub`, `presets`,
`cache`, `tokenizer_files`, `checkpoints` (`Checkpoint`, compatibility), `pairing` (the shared-base check),
`patterns` and `adapters` (PEFT adapters as experts).
"""
