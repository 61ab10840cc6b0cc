"""SNIP: statistics and metrics, the ILP (problem + solve), policies, rules, the brute-force oracle,
feasibility, the controller; talks to its host only through host.py's protocols.

May import: config, precision, model, parallel; never training, interop or the entry points.
"""
