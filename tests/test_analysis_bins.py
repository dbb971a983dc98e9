"""layerswap.analysis.bins: |Δ| histogram bins are ordered like the values; Hist counts per tensor."""

from __future__ import annotations

import numpy as np
import torch

from layerswap.analysis import NBINS, Hist, bin_index, bin_lower_value, boundary_bin


def test_bins_are_ordered_and_bin_zero_is_exactly_zero():
    v = torch.tensor([0.0, 1e-45, 1e-38, 1e-8, 0.001, 0.0010001, 1.0, 1e30], dtype=torch.float32)
    b = bin_index(v).tolist()
    assert b[0] == 0 and all(x >= 1 for x in b[1:]) and b == sorted(b)
    for value, bin_ in zip(v.tolist()[1:], b[1:]):
        assert bin_lower_value(bin_) <= value < bin_lower_value(bin_ + 1)
    assert max(b) < NBINS


def test_hist_counts_per_tensor_and_the_boundary_bin():
    dense = [np.zeros(NBINS, np.int64) for _ in range(3)]
    dense[0][[5, 9]] = [2, 3]
    dense[2][7] = 4  # tensor 1 is empty
    h = Hist.from_parts([Hist.trim(d) for d in dense])
    lo, c = h.tensor(0)
    assert lo == 5 and c.tolist() == [2, 0, 0, 0, 3] and h.tensor(1)[1].size == 0
    np.testing.assert_array_equal(h.count_ge(7), [3, 0, 4])
    np.testing.assert_array_equal(h.count_in(5), [2, 0, 0])
    np.testing.assert_array_equal(h.total(), sum(dense))
    assert boundary_bin(h.total(), 3) == 9 and boundary_bin(h.total(), 4) == 7 and boundary_bin(h.total(), 9) == 5
