"""What a merge is: `plans` (layer maps), `methods` (the merge-method registry of pure tensor functions), `fields`
(the recipe-field table), `recipes` (`Recipe`), and `sources`, the planner every consumer asks where each tensor
comes from.
"""
