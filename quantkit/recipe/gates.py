"""The gates a recipe (and `quantkit eval --gate`) may set: name -> what it bounds.

They live with the recipe because a recipe is validated before anything is evaluated; quantkit.evaluate reads
this table to apply them.
"""
# name -> (how to read the metric from a variant row and the base row, "max" or "min", what it needs)
GATES = {
    "max_ppl_increase": "relative perplexity increase over the baseline, e.g. 0.02 = +2% (needs --data)",
    "min_agreement": "fraction of task answers identical to the baseline's (needs --tasks)",
    "min_token_agreement": "fraction of positions whose top-1 token equals the baseline's",
    "max_kl_mean": "mean per-token KL from the baseline (nats)",
    "max_kl_p99": "99th percentile of per-token KL from the baseline (nats)",
    "min_exact_match": "fraction of task answers equal to the reference (needs --tasks with answers)",
}
