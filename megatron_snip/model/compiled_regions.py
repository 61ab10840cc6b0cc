"""Regional compilation (``training.compile``): the elementwise regions of a transformer block
through ``torch.compile``, as torchtitan compiles its blocks - where norms, RoPE, softmax and
SwiGLU's elementwise work get fused.

Compiled, each one graph shared by every block (the functions take tensors and ints only, the
weights as arguments, so one graph per input shape and dtype serves all layers):

* ``rms_norm`` - the block's two norms and the final norm;
* ``attention_core`` - RoPE on q and k, causal SDPA, the head reshapes;
* ``swiglu`` - silu(gate) * up;
* ``cross_entropy`` - the loss of unsharded logits (no TP): fp32 cast, log-softmax, target gather
  and mean in one graph (``LlamaModel.loss``). The LM head's GEMM stays eager like every linear;
  the vocab-parallel loss under TP (three collectives inside an autograd function) stays eager.
  ``python -m experiments.bench.head_loss``: 0.97x the eager loss + head time at a Llama
  vocabulary (32000) on a quiet CPU, ~1 ms slower at ``tiny``'s 320; the gradients are the eager bits.

Eager, and why:

* the four linears (``PrecisionLinear``): the quantized GEMM is a custom autograd function
  taking Python objects (the ``GemmPrecision``, the stochastic-rounding generator, the backend's
  GEMM runner); SNIP's probes replace a linear's GEMM with a Python callback per pass; the
  TP/SP collectives and the SP prefetch chain are autograd functions over process groups; the
  BF16 weight copies are a per-step Python cache. Their quantizers are compiled on their own
  (``precision/quantize/compiled.py``). Keeping the GEMMs outside the graphs is also what makes
  a plan switch free: dynamo never sees a precision, so a re-plan recompiles nothing;
* the residual adds (one elementwise op each between two linears: nothing to fuse with).

``recompute_cheap``'s checkpoint is not used inside a compiled region: AOTAutograd's partitioner
chooses what to save and recomputes cheap elementwise ops itself. Recompute of whole blocks or of
the core attention (``training.recompute``) wraps the compiled regions as it wraps eager ones.

Numerics: on CUDA the graphs compile with the eager-numerics options the quantizers use
(``compiled.eager_numerics_options``); a fused reduction can still sum in another order than
eager (the norm's mean over D, the softmax), so compiled training matches eager within a
tolerance, not bitwise (``tests/unit/test_compiled_regions.py`` derives it). A compile failure
falls back to eager for the rest of the process and is recorded once (``precision/fallbacks``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_snip.model.rope import apply_rope
from megatron_snip.precision import fallbacks
from megatron_snip.precision.quantize.compiled import eager_numerics_options

_COMPILED: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}
_FAILED: list[str] = []  # the first failure's cause; after it every region runs eager


def rms_norm(x_bsd: torch.Tensor, weight_d: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D) any float dtype -> (..., D) in x's dtype: x / rms(x) * weight, normalized in fp32."""
    x32 = x_bsd.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight_d).to(x_bsd.dtype)


def attention_core(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_groups: int,
                   head_dim: int) -> torch.Tensor:
    """Core attention (no weights): qkv (B, S, G·(H/G+2)·Hd) laid out per kv group as
    [q_0..q_{H/G-1}, k, v] -> (B, S, H·Hd), causal, RoPE on q and k (local heads under TP)."""
    q_per_group = num_heads // num_groups
    b, s, _ = qkv.shape
    qkv = qkv.view(b, s, num_groups, q_per_group + 2, head_dim)
    q = qkv[:, :, :, :q_per_group].reshape(b, s, num_heads, head_dim).transpose(1, 2)  # B H S Hd
    k = qkv[:, :, :, q_per_group].transpose(1, 2)  # B G S Hd
    # A compact copy: attention saves v for backward, and a view would keep the whole qkv
    # output alive (q and k are saved as RoPE's fresh outputs). Same values, same bits.
    v = qkv[:, :, :, q_per_group + 1].transpose(1, 2).contiguous()  # B G S Hd
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=num_groups != num_heads)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) [gate; up] -> silu(gate) * up (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def cross_entropy(logits_tv: torch.Tensor, targets_t: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy (nats, fp32) of logits (T, V) in any float dtype and targets (T,) int64."""
    return F.cross_entropy(logits_tv.float(), targets_t)


def compiled(fn: Callable[..., torch.Tensor], device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``fn`` through torch.compile for ``device``'s type (static shapes; on CUDA with the
    eager-numerics options), or None once a compile has failed in this process."""
    if _FAILED:
        return None
    key = (fn.__name__, device.type)
    if key not in _COMPILED:
        options = eager_numerics_options() if device.type == "cuda" else None
        if device.type == "cuda" and options is None:
            _fail("this torch's inductor has no correctly rounded division option")
            return None
        _COMPILED[key] = torch.compile(fn, dynamic=False, options=options)
    return _COMPILED[key]


def _fail(cause: str) -> None:
    _FAILED.append(cause)
    fallbacks.record("training.compile: compiled block regions failed; running them eagerly", cause)


def run(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``fn(*args)`` through its compiled graph (the first tensor argument's device), falling
    back to eager - for good, recorded - if compiling fails."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    graph = compiled(fn, device)
    if graph is not None:
        try:
            return graph(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: run eager from now on, say why once
            _fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return fn(*args)
