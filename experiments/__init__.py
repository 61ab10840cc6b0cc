"""Experiments on top of megatron_snip: the policy comparison, metric validation, method studies and
benchmarks behind docs/. Run each as ``python -m experiments.<name>`` from the repository root;
experiments/README.md has the map and the one-way import rule."""
