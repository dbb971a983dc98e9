"""Making merged models: `merging` (in-memory merges, the streaming export), `adapter_merge` (swaps done on two
adapters), `card` (provenance and the model card), `interop` (mergekit YAML), `publish` (push to the Hub), `outputs`
(where an output may go).
"""
