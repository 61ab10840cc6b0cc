"""The policy comparison behind docs/results/comparison/results.md, in pieces; ``experiments/compare_policies.py`` is its command line."""
