"""Start-up check: can every SNIP candidate format run every GEMM of this model, and can the FP4
target then be met? Decided before the first step, not at the first re-plan.

SNIP's statistics pass quantizes every GEMM in every candidate a plan may choose (``snip.formats``,
under a time target less the formats slower than BF16), and its policies may place any candidate on
any decision unit; a format whose blocks do not tile a GEMM's TP-local operands (rules:
``precision/gemm_shapes.py``) would stop the run at the first re-plan. So a format of
``snip.formats`` that cannot run some GEMM is refused here (every listed one: this check needs no
time costs), with each GEMM it cannot run and why, the largest FP4 share the other GEMMs leave
reachable, whether ``snip.fp4_target`` is within it, and the fields that fix it.
"""

from __future__ import annotations

from megatron_snip.config import Config
from megatron_snip.model.shapes import linear_numel, local_linear_shapes, model_linear_shapes
from megatron_snip.precision.formats import FP4_FORMATS
from megatron_snip.precision.gemm_shapes import gemm_shape_error
from megatron_snip.precision.plan import GEMMS, LINEARS

# which config field sets each dim of a linear's (N, K) weight; T = tokens per micro-batch
_DIM_FIELDS = {"qkv": ("model.num_attention_heads/num_kv_heads", "model.hidden_size"),
               "proj": ("model.hidden_size", "model.hidden_size"),
               "fc1": ("model.ffn_hidden_size", "model.hidden_size"),
               "fc2": ("model.hidden_size", "model.ffn_hidden_size")}


def unrunnable_gemms(cfg: Config, tp: int) -> dict[str, dict[tuple[str, str], str]]:
    """format -> {(linear, gemm): why it cannot run there} for each candidate in ``snip.formats``
    (every block has the same shapes, so a (linear, gemm) pair stands for all layers)."""
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    local = local_linear_shapes(model_linear_shapes(cfg.model), tp)
    out: dict[str, dict[tuple[str, str], str]] = {}
    for fmt in cfg.snip.formats:
        bad = {(lin, g): err for lin in LINEARS for g in GEMMS
               if (err := gemm_shape_error(fmt, g, *local[lin], tokens)) is not None}
        if bad:
            out[fmt] = bad
    return out


def max_fp4_share(cfg: Config, unrunnable: dict[str, dict[tuple[str, str], str]]) -> float:
    """The largest share of linear-layer FLOPs some FP4 candidate can run (a decision unit of
    granularity "layer" is a linear's three GEMMs together)."""
    numel = linear_numel(model_linear_shapes(cfg.model))
    units = [(lin, gs) for lin in LINEARS for gs in ([GEMMS] if cfg.snip.granularity == "layer" else [(g,) for g in GEMMS])]
    fp4 = [f for f in cfg.snip.formats if f in FP4_FORMATS]
    reachable = sum(numel[lin] * len(gs) for lin, gs in units
                    if any(not any((lin, g) in unrunnable.get(f, {}) for g in gs) for f in fp4))
    return reachable / (sum(numel.values()) * len(GEMMS))


def check_candidates_runnable(cfg: Config, tp: int) -> None:
    """Raise ValueError (GEMMs, formats, reachable FP4 share, fixes) if SNIP is on and a candidate
    format cannot run some GEMM at this TP degree and micro-batch."""
    if not cfg.snip.enabled:
        return
    unrunnable = unrunnable_gemms(cfg, tp)
    if not unrunnable:
        return
    lines = []
    for fmt, bad in unrunnable.items():
        (lin, g), why = next(iter(bad.items()))
        names = ", ".join(f"{lin}.{g}" for lin, g in bad)
        lines.append(f"format {fmt!r} cannot run GEMM(s) {names} of every layer (e.g. {lin}.{g}: {why})")
    share = max_fp4_share(cfg, unrunnable)
    target = cfg.snip.fp4_target
    verdict = (f"snip.fp4_target={target} could not be met either: the other candidates reach at most {share:.1%} "
               f"of linear FLOPs in FP4" if share < target else
               f"the other GEMMs could still reach {share:.1%} of linear FLOPs in FP4 (snip.fp4_target={target})")
    # fprop/dgrad block K or N (a weight dim), wgrad blocks the tokens of the micro-batch
    fields = sorted({f for bad in unrunnable.values() for lin, g in bad
                     for f in (_DIM_FIELDS[lin] if g != "wgrad" else ("training.micro_batch_size", "training.seq_len"))})
    raise ValueError(
        f"config snip.formats={list(cfg.snip.formats)} (parallel.tp={tp}, training.micro_batch_size x seq_len = "
        f"{cfg.training.micro_batch_size * cfg.training.seq_len} tokens): " + "; ".join(lines) + f"; {verdict}. "
        f"SNIP measures and may choose every candidate on every GEMM, so the run would stop at the first re-plan. "
        f"Fix: make the dims named above multiples of the format's block (fields {', '.join(fields)}, local to each "
        f"TP rank), or drop the format from snip.formats")
