"""Where did each expert change, do the changes overlap, and what did the merge keep?

`analyze(base, math, lang)` streams the three checkpoints once, tensor by tensor in slices
(`stream`), and returns an `Analysis`: for every tensor (a cell of the layer x
parameter-type grid, or an embedding / final norm / lm_head tensor, reported separately)

* relative change      ‖θ_e − θ_base‖_F / ‖θ_base‖_F          for each expert e
* mean absolute change  mean |θ_e − θ_base|
* top-k share          the fraction of the model's top-k% most-changed entries (largest
                       |θ_e − θ_base| over *all* tensors) that lies in this tensor
* overlap              cosine of the two task vectors Δ_math, Δ_lang, and the Jaccard index of
                       the two experts' top-k% sets inside the tensor
* math vs language     ‖θ_math − θ_lang‖_F / ‖θ_base‖_F and mean |θ_math − θ_lang|

`Analysis.merged(plan, ...)` adds the layer-swapped model against the base and against each
expert; tensors the plan copies from an expert reuse that expert's numbers exactly, and only
blended tensors are read again.

This reconstructs the paper's "magnitude of change during SFT" analysis (Bandarkar et al., 2025,
whose exact metric and normalisation are not verifiable from its public text) as several views.

How the top-k% is exact
-----------------------
|Δ| is computed in float32 from the stored values. K = round(k/100 · N) over all N entries; the
threshold t is the K-th largest |Δ|. Entries tied at t are shared fractionally (each gets
(K − #{|Δ| > t}) / #{|Δ| = t}), so every share is exact and the shares sum to 1. This is the
expectation under random tie-breaking, which matters for bf16 checkpoints, where many
changes are a few units in the last place.

1. A sample pass reads 0.4% of the entries, at most about 2M (blocks spread over every
   tensor), and estimates a window of |Δ| values that holds t with a wide margin.
2. The main pass computes all sums, an exact per-tensor histogram of |Δ| on 32768 bins (the top
   16 bits of the float32 pattern, rounded up, so bin 0 holds exactly the zeros), and keeps the
   exact value of every entry that falls inside the window (a few percent of K entries, stored
   as distinct values with counts) plus, for the overlap, the pairs where both experts are at
   or above their windows.
3. The histograms give exact counts above the window; the kept values give t and the counts
   around it exactly. If t fell outside the window (a poor sample, or too many distinct values
   in it), two more passes finish the job exactly: the histograms locate t's bin, a 65536-bin
   histogram inside that bin gives t, and a last pass counts every class per tensor.
   `TopK.passes` says which happened (1 or 3).

The merged model's top-k share is not re-derived per entry: it is located on the histograms
(exact counts above and below the threshold's bin) and the entries of that one bin are shared
in proportion; `MergedTopK.max_error` states the largest possible error of any share.

A family (one math expert, N language experts from one base): `analyze_family(base, math,
{code: lang})` streams base, math and the N language experts together and feeds each slice to
one pass per language, so base and math are read once for all: N + 2 checkpoint reads, not 3N.
Each language's `Analysis` is the one `analyze(base, math, lang)` gives (and is cached as such).

Memory: the reader's buffers (3 checkpoints x 3 slices) plus about a dozen float32 slices of
working space, and the kept window entries; never a whole tensor. Results are cached on disk
under ``$LAYERSWAP_CACHE/analysis`` (default ``~/.cache/layerswap/analysis``), keyed by the
checkpoints' fingerprints (file names, sizes, mtimes and header bytes).

Where each part lives (each module imports only those above it; torch is loaded only by
`kernels`, `compiled` and `passes`, when something is computed, numba only by `_numba`):

    records    panels and metrics, TensorMeta, TopK, RunInfo, which computed k a query means
    bins       the |Δ| histogram bins and the per-tensor histograms (Hist)
    stream     ChunkStream: slices of the same tensors from several checkpoints, read ahead
    kernels    the per-slice arithmetic (torch) and the handler each pass feeds
    compiled   the main pass on CPU as one compiled loop (numba, when installed; `_numba` holds the loops)
    passes     the sample, the main pass, the exact fallback passes, the threaded driver
    suggest    the plan suggestion (PlanSuggestion, SUGGEST_RULE)
    merged     the merged model's statistics (MergedStats, MergedTopK)
    store      the .npz format and the cache folder
    results    Analysis and its queries, the report text, format_value / format_row, write_csv
    pipeline   analyze(), analyze_family()
"""


from layerswap.analysis.bins import NBINS, Hist, bin_index, bin_lower_value, boundary_bin
from layerswap.analysis.merged import MergedStats, MergedTopK
from layerswap.analysis.pipeline import analyze, analyze_family
from layerswap.analysis.records import DEFAULT_KS, METRICS, PANEL_METRICS, PANELS, RunInfo, TensorMeta, TopK
from layerswap.analysis.results import Analysis, format_row, format_value, write_csv
from layerswap.analysis.store import CACHE_KEEP, FORMAT_VERSION
from layerswap.analysis.stream import CPU_CHUNK, CUDA_CHUNK
from layerswap.analysis.suggest import SUGGEST_RULE, PlanSuggestion

__all__ = [
    "CACHE_KEEP", "CPU_CHUNK", "CUDA_CHUNK", "DEFAULT_KS", "FORMAT_VERSION", "METRICS", "NBINS", "PANELS",
    "PANEL_METRICS", "SUGGEST_RULE", "Analysis", "Hist", "MergedStats", "MergedTopK",
    "PlanSuggestion", "RunInfo", "TensorMeta", "TopK", "analyze", "analyze_family", "bin_index", "bin_lower_value",
    "boundary_bin",
    "format_row", "format_value", "write_csv",
]
