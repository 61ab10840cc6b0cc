"""Linear layers whose GEMMs run in plan-chosen precisions, and their tensor-parallel forms.

``PrecisionLinear`` is the seam between the model and the numerics: the model
builds one per (block, linear) and names it globally (``layer``, ``linear``);
``set_precision`` switches its three GEMMs (fprop, dgrad, wgrad) between steps
without rebuilding anything. Tensor-parallel subclasses wrap the local GEMM in
communication through ``_input_comm`` / ``_output_comm`` (Megatron's mappings, see
parallel/comm.py):

* ``ColumnParallelLinear`` (qkv, fc1): weight rows (output features) sharded; input
  replicated (``copy_to_tp``) or, with sequence parallelism, gathered along the sequence.
  ``partitions`` > 1 shards each of that many equal output blocks separately (fc1's
  [gate; up] -> local [gate_r; up_r]).
* ``RowParallelLinear`` (proj, fc2): weight columns (input features) sharded; partial
  outputs summed (``reduce_from_tp``) or reduce-scattered along the sequence.
* ``VocabParallelEmbedding``, ``ParallelLMHead`` and ``vocab_parallel_cross_entropy``:
  the vocabulary is sharded over TP; the full (B, S, V) logits never exist on one rank.

Tensor scales under TP (``set_tp_amax``, ``precision.tp_amax``): "tensor" reduces the amax of
each *sharded* operand over the TP group, so every shard scales like the unsharded tensor, and
skips the replicated ones, whose local amax already is the whole tensor's: a column-parallel
linear's X (copied to every rank, or all-gathered under sequence parallelism before it is
quantized) and a row-parallel linear's dY (the identity backward of the all-reduce, or the
all-gather backward of the reduce-scatter under sequence parallelism). "shard" reduces nothing:
each shard scales by its own amax, as Transformer Engine does per module - valid because each
partial GEMM is dequantized before the partial results are summed.

Initialization is layout-independent: each weight is drawn in full from its own generator
(seeded by the model seed and the parameter's global name) and then sliced, so a TP=2 or
PP=2 model holds exactly the shards of the TP=1 / PP=1 model built from the same seed.
``shard_tensor`` / ``unshard_tensors`` convert between full and sharded weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_snip.model import compiled_regions
from megatron_snip.parallel import comm
from megatron_snip.parallel.sequence_shard import save_sequence_shard
from megatron_snip.parallel.topology import TensorParallel
from megatron_snip.precision.backends import Backend, get_backend
from megatron_snip.precision.capability import QUANT_LINEAR_BACKENDS
from megatron_snip.precision.gemm import TP_AMAX_MODES, AmaxReducers, activation_dtype
from megatron_snip.precision.plan import GemmPrecision
from megatron_snip.precision.weight_copies import WeightCopy

UNSHARDED = TensorParallel()


class LinearProbe(Protocol):
    """Replaces a linear's local GEMM while SNIP statistics are collected (see snip/stats.py)."""

    def __call__(self, module: PrecisionLinear, x: torch.Tensor) -> torch.Tensor: ...


# --- sharding helpers ---------------------------------------------------------------------------
def shard_tensor(full: torch.Tensor, dim: int, size: int, rank: int, partitions: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` split ``size`` ways along ``dim``.

    ``full`` is viewed as ``partitions`` equal contiguous blocks along ``dim``; each block is
    split separately and the rank's pieces are concatenated (fc1: [gate; up] -> [gate_r; up_r]).
    """
    if full.shape[dim] % (size * partitions):
        raise ValueError(f"dim {dim} of size {full.shape[dim]} does not split into {partitions} part(s) "
                         f"x {size} tensor-parallel shards")
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in full.chunk(partitions, dim=dim)], dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], dim: int, partitions: int = 1) -> torch.Tensor:
    """Inverse of ``shard_tensor``: the full tensor from every rank's shard (in TP-rank order)."""
    per_rank = [s.chunk(partitions, dim=dim) for s in shards]
    return torch.cat([torch.cat([r[p] for r in per_rank], dim=dim) for p in range(partitions)], dim=dim)


def init_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for parameter ``name`` (its global name, e.g. 'layers.3.mlp.fc1.weight')."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


@torch.no_grad()
def _init_normal(weight: torch.Tensor, full_shape: tuple[int, ...], std: float, generator: torch.Generator | None,
                 shard: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Fill ``weight`` (a shard) with its slice of a full N(0, std²) tensor drawn from ``generator``."""
    if weight.is_meta:  # sizing builds on the meta device: nothing to draw
        return
    if generator is None and tuple(weight.shape) == tuple(full_shape):
        weight.normal_(0.0, std)  # legacy path: the global RNG
        return
    full = torch.empty(full_shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)
    weight.copy_(shard(full))


def _mark(param: nn.Parameter, *, tensor_parallel: bool = False, sequence_parallel: bool = False) -> None:
    # Read by parallel/ddp.py: sharded params count in the grad norm on every TP rank,
    # replicated ones once; sequence-parallel ones need their grads summed over TP.
    param.tensor_parallel = tensor_parallel  # type: ignore[attr-defined]
    param.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]


# --- linear layers --------------------------------------------------------------------------------
class PrecisionLinear(nn.Module):
    """y = x·Wᵀ with each GEMM in its own format.

    Shapes: x (..., in_features) -> y (..., out_features); ``weight`` is the fp32
    master weight (out_features, in_features) - the *local* shard under TP. The
    constructor takes the *global* sizes; ``global_shape`` = (N, K) unsharded.

    Attributes set from outside between steps:
        precision: the GemmPrecision of this layer's fprop/dgrad/wgrad.
        generator: torch.Generator for stochastic rounding (shared by the model).
        amax_reduce: the amax reduction of each operand over the TP group (``set_tp_amax``;
            None: every operand scales by its local amax).
        probe: a LinearProbe while SNIP statistics are being collected, else None.
        backend: the ``Backend`` that runs the GEMMs (emulated until ``LlamaModel.set_backend``).
        weight_copy: the step's copy of the weight in the activation dtype, for the reference path
            (precision/weight_copies.py; scoped by ``LlamaModel.weight_copies_for_step``).
    """

    shard_dim: int | None = None  # weight dim split over TP (None: replicated)
    # Operands identical on every TP rank when quantized (their local amax is the whole tensor's).
    replicated_operands: frozenset[str] = frozenset({"x", "w", "dy"})

    def __init__(self, in_features: int, out_features: int, *, layer: int, linear: str, init_std: float,
                 tp: TensorParallel = UNSHARDED, partitions: int = 1, init_generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.tp, self.partitions = tp, partitions
        self.global_shape = (out_features, in_features)
        n, k = out_features, in_features
        if self.shard_dim is not None and self.global_shape[self.shard_dim] % (tp.size * partitions):
            name = "out_features" if self.shard_dim == 0 else "in_features"
            raise ValueError(f"{type(self).__name__} layer={layer} linear={linear}: {name}="
                             f"{self.global_shape[self.shard_dim]} is not divisible by {partitions} part(s) x "
                             f"tp={tp.size}; change parallel.tp or the model sizes")
        if self.shard_dim == 0:
            n //= tp.size
        elif self.shard_dim == 1:
            k //= tp.size
        self.in_features, self.out_features = k, n
        self.layer, self.linear = layer, linear
        self.weight = nn.Parameter(torch.empty(n, k))
        _mark(self.weight, tensor_parallel=self.shard_dim is not None and tp.size > 1)
        self.init_std = init_std
        self.precision = GemmPrecision()
        self.generator: torch.Generator | None = None
        self.amax_reduce: AmaxReducers | None = None
        self.set_tp_amax("tensor")
        self.probe: LinearProbe | None = None
        # Runs the GEMMs: the reference until LlamaModel.set_backend installs the configured one.
        self.backend: Backend = get_backend("emulated")
        self.weight_copy = WeightCopy()
        self.reset_parameters(init_generator)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full (N, K) weight (or of anything laid out like it)."""
        if self.shard_dim is None or self.tp.size == 1:
            return full
        return shard_tensor(full, self.shard_dim, self.tp.size, self.tp.rank, self.partitions)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """N(0, init_std²); with a generator, drawn in full and sliced (layout-independent)."""
        _init_normal(self.weight, self.global_shape, self.init_std, generator, self.shard)

    def set_precision(self, precision: GemmPrecision) -> None:
        self.precision = precision

    def set_tp_amax(self, mode: str) -> None:
        """Which amax formats with a tensor scale use under TP (module docstring): ``"tensor"``
        (sharded operands reduced over ``tp.group``) or ``"shard"`` (local amaxes)."""
        if mode not in TP_AMAX_MODES:
            raise ValueError(f"precision.tp_amax={mode!r}: choose one of {TP_AMAX_MODES}")
        reduce = comm.amax_reducer(self.tp.group) if mode == "tensor" else None
        reducers = AmaxReducers(**{op: None if op in self.replicated_operands else reduce for op in ("x", "w", "dy")})
        self.amax_reduce = reducers if reducers.reduces else None

    def local_gemm(self, x: torch.Tensor, precision: GemmPrecision | None = None) -> torch.Tensor:
        """The quantized GEMM on the local shard, optionally in another precision (used by probes).

        Under TP this may all-reduce amaxes over the TP group (``amax_reduce``), so every TP
        rank must call it the same number of times with the same formats."""
        precision = precision or self.precision
        weight = self.weight
        if precision.is_reference and self.backend.name in QUANT_LINEAR_BACKENDS:
            # quant_linear's reference path multiplies the weight in x's dtype: hand it the step's copy.
            weight = self.weight_copy.get(weight, activation_dtype(x))
        return self.backend.linear(x, weight, precision, amax_reduce=self.amax_reduce, generator=self.generator,
                                   is_first_microbatch=self.weight_copy.first_microbatch(self.weight, precision))

    def _input_comm(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _output_comm(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input_comm(x)
        y = self.probe(self, x) if self.probe is not None else self.local_gemm(x)
        return self._output_comm(y)

    def extra_repr(self) -> str:
        p = self.precision
        tp = f", tp={self.tp.size}" if self.tp.size > 1 else ""
        return (f"{self.in_features}->{self.out_features}{tp}, layer={self.layer}, linear={self.linear}, "
                f"precision=({p.fprop},{p.dgrad},{p.wgrad})")


class ColumnParallelLinear(PrecisionLinear):
    """Output features sharded over TP: x (..., K) replicated -> y (..., N/tp) local.

    Input comm: ``copy_to_tp`` (identity fwd / all-reduce of dX bwd), or with sequence
    parallelism ``gather_from_sp`` (x arrives (B, S/tp, K), is all-gathered to (B, S, K);
    dX is reduce-scattered back). Output stays sharded. Group: ``tp.group``.
    """

    shard_dim = 0
    replicated_operands = frozenset({"x"})
    # Under SP, save the input's sequence shard and re-gather it in backward (parallel/sequence_shard.py;
    # inside LlamaModel.forward's prefetch_chain the re-gather starts one saved input early);
    # LlamaModel.set_recompute turns it off inside fully recomputed blocks.
    save_input_shard = True

    def _input_comm(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            return comm.gather_from_sp(x, self.tp.group)
        return comm.copy_to_tp(x, self.tp.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.tp.sequence_parallel and self.save_input_shard and self.probe is None
                and self.backend.name in QUANT_LINEAR_BACKENDS and torch.is_grad_enabled()):
            return super().forward(x)
        x_full = self._input_comm(x)
        with save_sequence_shard(x_full, x, self.tp.group):
            return self.local_gemm(x_full)


class RowParallelLinear(PrecisionLinear):
    """Input features sharded over TP: x (..., K/tp) local -> y (..., N) summed over TP.

    Output comm: ``reduce_from_tp`` (all-reduce fwd / identity bwd), or with sequence
    parallelism ``reduce_scatter_to_sp`` (output (B, S/tp, N)). Group: ``tp.group``.
    """

    shard_dim = 1
    replicated_operands = frozenset({"dy"})

    def _output_comm(self, y: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            return comm.reduce_scatter_to_sp(y, self.tp.group)
        return comm.reduce_from_tp(y, self.tp.group)


# --- vocabulary-parallel embedding, LM head and loss --------------------------------------------------
class _VocabShardedWeight(nn.Module):
    """A (V/tp, D) weight holding rows [rank·V/tp, (rank+1)·V/tp) of a full (V, D) N(0, std²) matrix.

    Shared by the embedding and the LM head: the same vocabulary split, initialisation (each
    rank draws the full matrix from ``init_generator`` and keeps its slice, so TP=1 and TP=n
    models start identical) and TP marking.
    """

    def __init__(self, vocab_size: int, dim: int, *, init_std: float, tp: TensorParallel,
                 init_generator: torch.Generator | None) -> None:
        super().__init__()
        if vocab_size % tp.size:
            raise ValueError(f"vocabulary size {vocab_size} is not divisible by parallel.tp={tp.size}; set "
                             f"model.vocab_size to a multiple of {64 * tp.size} (or 0 to pad the tokenizer's)")
        self.tp, self.vocab_size, self.dim = tp, vocab_size, dim
        self.per_rank = vocab_size // tp.size
        self.vocab_start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        _mark(self.weight, tensor_parallel=tp.size > 1)
        self.init_std = init_std
        self.reset_parameters(init_generator)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.tp.size == 1 else shard_tensor(full, 0, self.tp.size, self.tp.rank)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        _init_normal(self.weight, (self.vocab_size, self.dim), self.init_std, generator, self.shard)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}x{self.dim}, local rows {self.vocab_start}..{self.vocab_start + self.per_rank}"


class VocabParallelEmbedding(_VocabShardedWeight):
    """Token embedding with the vocabulary (rows) sharded over TP: ids (B, S) -> (B, S, D).

    Each rank looks up the ids in its range [rank·V/tp, (rank+1)·V/tp), zeroes the others and
    the partial rows are summed over TP (exactly one rank contributes per token, so the sum is
    exact); with sequence parallelism the sum is a reduce-scatter to (B, S/tp, D).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float, tp: TensorParallel = UNSHARDED,
                 init_generator: torch.Generator | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, init_std=init_std, tp=tp, init_generator=init_generator)

    def forward(self, ids_bs: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids_bs, self.weight)
        outside = (ids_bs < self.vocab_start) | (ids_bs >= self.vocab_start + self.per_rank)
        local_ids = (ids_bs - self.vocab_start).masked_fill(outside, 0)
        h = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return comm.reduce_scatter_to_sp(h, self.tp.group)
        return comm.reduce_from_tp(h, self.tp.group)


class ParallelLMHead(_VocabShardedWeight):
    """Column-parallel LM head in the training dtype: h (B, S, D) -> local logits (B, S, V/tp).

    Input comm as ``ColumnParallelLinear`` (copy_to_tp, or gather_from_sp under sequence
    parallelism). The logits stay vocab-sharded; ``vocab_parallel_cross_entropy`` consumes them.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, init_std: float, tp: TensorParallel = UNSHARDED,
                 init_generator: torch.Generator | None = None) -> None:
        super().__init__(vocab_size, hidden_size, init_std=init_std, tp=tp, init_generator=init_generator)
        self.weight_copy = WeightCopy()  # autocast's BF16 copy, once per step (precision/weight_copies.py)

    def forward(self, h_bsd: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            h_bsd = comm.gather_from_sp(h_bsd, self.tp.group)
        else:
            h_bsd = comm.copy_to_tp(h_bsd, self.tp.group)
        return F.linear(h_bsd, self.weight_copy.get(self.weight, activation_dtype(h_bsd)))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocab-sharded logits (Megatron's), all reductions over the TP group.

    Forward: global max (all-reduce MAX), target logit (all-reduce SUM: only the owning rank
    contributes), sum of exponentials (all-reduce SUM); loss = log Σexp − target logit.
    Backward: softmax − one-hot on the local vocabulary slice; no communication.
    """

    @staticmethod
    def forward(ctx, logits_tv: torch.Tensor, target_t: torch.Tensor, group: Any, vocab_start: int) -> torch.Tensor:
        logits_tv = logits_tv.float()
        v_local = logits_tv.shape[-1]
        logits_max = comm.all_reduce_max(logits_tv.max(dim=-1).values, group)
        shifted = logits_tv - logits_max.unsqueeze(-1)
        outside = (target_t < vocab_start) | (target_t >= vocab_start + v_local)
        local_t = (target_t - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce_sum(target_logit, group)
        exp = shifted.exp()
        sum_exp = comm.all_reduce_sum(exp.sum(dim=-1), group)
        loss = torch.log(sum_exp) - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss_t: torch.Tensor):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss_t.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits_bsv: torch.Tensor, targets_bs: torch.Tensor,
                                 tp: TensorParallel = UNSHARDED, *, compiled: bool = False) -> torch.Tensor:
    """Mean token cross entropy (nats, fp32) of logits whose last dim is this rank's vocab slice.

    Without TP this is ``F.cross_entropy`` on the full logits (``compiled``: through its compiled
    graph, ``compiled_regions.cross_entropy``). Every TP rank returns the same loss.
    """
    if tp.size == 1:
        args = (logits_bsv.reshape(-1, logits_bsv.shape[-1]), targets_bs.reshape(-1))
        loss_fn = compiled_regions.cross_entropy
        return compiled_regions.run(loss_fn, *args) if compiled else loss_fn(*args)
    v_local = logits_bsv.shape[-1]
    per_token = _VocabParallelCrossEntropy.apply(logits_bsv.reshape(-1, v_local), targets_bs.reshape(-1),
                                                 tp.group, tp.rank * v_local)
    return per_token.mean()


# --- state-dict sharding ----------------------------------------------------------------------
ShardSpec = Mapping[str, "tuple[int, int] | None"]  # param name -> (dim, partitions), None = replicated


def shard_state_dict(full: Mapping[str, torch.Tensor], spec: ShardSpec, size: int, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s state dict from an unsharded one (names as in ``spec``; others copied)."""
    out = {}
    for name, t in full.items():
        s = spec.get(name)
        out[name] = t if s is None or size == 1 else shard_tensor(t, s[0], size, rank, s[1])
    return out


def unshard_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]], spec: ShardSpec) -> dict[str, torch.Tensor]:
    """The unsharded state dict from every TP rank's (in TP-rank order); replicated entries from rank 0."""
    out = {}
    for name, t in shards[0].items():
        s = spec.get(name)
        out[name] = t if s is None or len(shards) == 1 else unshard_tensors([sd[name] for sd in shards], s[0], s[1])
    return out


def scaled_init_std(init_std: float, num_layers: int) -> float:
    """Output projections (proj, fc2) get std / sqrt(2·num_layers) (GPT-2 / Megatron)."""
    return init_std / math.sqrt(2.0 * num_layers)
