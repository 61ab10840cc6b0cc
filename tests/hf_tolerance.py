"""How close our fp32 logits must be to transformers' LlamaForCausalLM: a bound from this machine's
own fp32 rounding on the same model and input, not a constant measured on one CPU.

Both models compute the same real-valued function and differ only in the order of some sums (our
fused q/k/v and gate/up GEMMs are slices of HF's separate ones; the SDPA path; RoPE's cos/sin from
an outer product vs a matmul). Each fp32 evaluation is within a bound of the same form (about
gamma_K * sum|x||w| per dot product, propagated through the same layers) of the exact value, and
the reference's own distance from its fp64 evaluation, e = max|HF_fp32 - HF_fp64|, measures that
bound's size here. Two fp32 evaluations then differ by at most the sum of their errors: we allow
4e (2e for the sum, twice again for another summation order's constant). Another CPU's matmul
blocking changes e with the differences it causes. A wrong weight mapping moves logits by O(1)
(the tests spread the weights so that logits differ by O(1) between tokens), far above 4e (~1e-5).
"""

from __future__ import annotations

import copy

import torch


def logits_atol(hf_model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """4 x max |fp32 logits - fp64 logits| of ``hf_model`` (an fp32 LlamaForCausalLM) on ``tokens``."""
    ref64 = copy.deepcopy(hf_model).double().eval()
    with torch.no_grad():
        fp32, fp64 = hf_model(tokens).logits, ref64(tokens).logits
    err = (fp32.double() - fp64).abs().max().item()
    assert err > 0, "fp32 logits equal fp64 ones exactly: no rounding scale to derive a bound from"
    return 4 * err
