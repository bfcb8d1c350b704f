"""HF's sampling filters in numpy, by sorting: the reference sampling.filtered_logits is checked against (it finds the
thresholds by bisection), and the distributions the rejection-sampling tests expect, independent of our code."""

import numpy as np


def sorted_filter(logits, top_k, top_p):
    """HF's top-k / top-p rule over one row of (temperature-scaled) logits, by sorting (float64 mass): the kept
    entries."""
    order = np.argsort(-logits, kind="stable")
    desc = logits[order]
    keep = np.ones(len(logits), bool) if top_k == 0 else desc >= desc[top_k - 1]
    p = np.where(keep, np.exp(desc - desc.max()), 0.0)
    p /= p.sum()
    n_keep = max(int(np.sum(np.cumsum(p) - p < top_p)), 1)
    threshold = max(desc[n_keep - 1], desc[top_k - 1] if top_k else -np.inf)
    return logits >= threshold


def filtered_probs(logits, temperature, top_k, top_p):
    """One row's sampling distribution (float64) in HF's order: temperature, then top-k, then top-p."""
    scaled = np.asarray(logits, np.float32) / np.float32(temperature)
    keep = sorted_filter(scaled, top_k, top_p)
    e = np.where(keep, np.exp(scaled.astype(np.float64) - scaled.max()), 0.0)
    return e / e.sum()
