"""Find the plan: search layer-swap plans with an evaluation in the loop, chosen on dev, scored on held-out questions.

    from layerswap.search import SearchConfig, search
    result = search("math/", "lang/", "base/", SearchConfig(langs=["sw"], budget=40))
    result.plan, result.test["interval"], result.to_dict()      # also `layerswap search` and the page's panel

Where each part lives (each module imports only those above it):

    space     the plans a search may try (b, u, tb, tu at any depth, transitions, non-layer, module-wise, reverts)
    split     the dev / test split: the models' own dev file, else drawn (disjoint, the same ids in every language)
    prior     where it starts: the weight-diff prior and the τ rule's plans
    race      successive halving on questions, the paired standard error deciding promotions
    store     records in a sweeps results file (content keyed: resumable, reused by later searches), each chunk
              evaluated through `sweeps.loop.measure`; `race_job`, a candidate raced on a `sweeps.ray.Pool` worker
    strategy  every plan when the space fits the budget, else Optuna's TPE seeded with the priors
    report    the honest result: dev (optimistic), test with its interval, McNemar against the baselines
    run       the driver (`search`; `for_models`: the dev file and answer length the models bring)
"""

from layerswap.search.prior import Prior, priors, tau_rule
from layerswap.search.race import race, rungs
from layerswap.search.report import SearchResult, Trial
from layerswap.search.run import SearchConfig, default_results, for_models, search
from layerswap.search.space import Space, grid_space
from layerswap.search.split import Split, split_questions

__all__ = ["Prior", "SearchConfig", "SearchResult", "Space", "Split", "Trial", "default_results", "for_models",
           "grid_space", "priors", "race", "rungs", "search", "split_questions", "tau_rule"]
