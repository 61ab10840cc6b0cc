"""The costs the ILP solves (``solver_costs``): the measured (or remembered) costs with the soft terms the
config turns on - the kept forward formats' discount (``snip.forward_stickiness``,
``cost_memory.kept_forward``) and the depth prior on the forward GEMMs (``snip.forward_depth_prior``,
below). The measured costs stay the plan's predicted divergence and ``snip.cost_ema``'s memory. The
controller and ``scripts/solve_plan.py --run-dir`` both call ``solver_costs``.

Why a depth prior on the forward GEMMs: a forward GEMM's quantization error is measured against BF16
on the current weights, but the final model is evaluated after the blocks downstream of it trained
with that error. Evaluated one block at a time on final weights that trained in a stable plan, an FP4
forward GEMM costs less the earlier it sits (1.66M, development bases: blocks 0-3 cost 0.00034 ±
0.00004 less per FP4 forward GEMM than blocks 4-7; block 0's are below BF16), while SNIP's statistics
price block 0's forward GEMMs among the dearest (docs/results/kept_forward/results.md). NVIDIA's recipe
keeps its FP4 forward GEMMs in the first blocks (arXiv 2509.25149 App. E).

Pure functions: no ranks, no logging.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_snip.config import SnipConfig
from megatron_snip.precision.plan import GemmId
from megatron_snip.snip.cost_memory import kept_forward

Costs = Mapping[GemmId, Mapping[str, float]]


def depth_factors(num_layers: int, power: float) -> list[float]:
    """m(l) = ((l + 1/2) / L) ** power, divided by its mean over the L blocks (so the factors average 1
    and a prior moves cost between blocks, not between forward and backward GEMMs); all 1 at power 0."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    if not power >= 0:
        raise ValueError(f"forward_depth_prior={power} must be >= 0")
    raw = [((layer + 0.5) / num_layers) ** power for layer in range(num_layers)]
    mean = sum(raw) / num_layers
    return [x / mean for x in raw]


def depth_weighted(costs: Costs, num_layers: int, power: float) -> dict[GemmId, dict[str, float]]:
    """The costs with each forward GEMM's row (every format) of block l times ``depth_factors(...)[l]``;
    backward GEMMs as they are. A copy: ``costs`` itself is never changed; an infinite cost stays so."""
    m = depth_factors(num_layers, power)
    out: dict[GemmId, dict[str, float]] = {}
    for g, per_f in costs.items():
        if not 0 <= g.layer < num_layers:
            raise ValueError(f"GEMM {g.key} is outside the model's {num_layers} blocks")
        out[g] = {f: c * m[g.layer] for f, c in per_f.items()} if g.gemm == "fprop" else dict(per_f)
    return out


def solver_costs(costs: Costs, snip: SnipConfig, num_layers: int, in_force: Mapping[GemmId, str]) -> Costs:
    """``costs`` with ``snip``'s soft terms: each forward GEMM's cost in its format under the plan in force
    (``in_force``: GemmId -> format; only read when ``snip.forward_stickiness > 0``) discounted, then the
    forward GEMMs weighted by depth over ``num_layers`` blocks; ``costs`` itself when both are 0."""
    solved = costs
    if snip.forward_stickiness > 0:
        solved = kept_forward(solved, in_force, snip.forward_stickiness)
    if snip.forward_depth_prior > 0:
        solved = depth_weighted(solved, num_layers, snip.forward_depth_prior)
    return solved
