"""The dry run's activation memory is what the code saves: bytes saved for backward per token per
block, measured with ``torch.autograd.graph.saved_tensors_hooks`` on one block of a small model
(``training/saved_bytes.measure_block``),
against ``sizing.activation_bytes`` (exactly: the formula names every tensor the code saves) for
each setting the formula distinguishes. And the savings change no numbers: the norm and SwiGLU
intermediates recomputed in backward (model/recompute.py) give bitwise the gradients of saving them.

Counted: every distinct storage a block's forward saves for backward, except the parameters and
the model's cached RoPE tables (held anyway); autocast's BF16 copies of the block's weights are
not per token and are checked on their own. Sequence length 48 with micro-batch
2 makes T = 96 tokens differ from every model dim, so a weight copy is never mistaken for an activation.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL

from megatron_snip.config import load_config
from megatron_snip.sizing import activation_bytes
from megatron_snip.training.saved_bytes import measure_block
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"


def measure(tmp_path, *extra: str) -> tuple[float, int]:
    """(activation bytes per token saved by block 1, bytes of autocast weight copies it saved)."""
    over = SMALL + ["model.ffn_hidden_size=80", "training.seq_len=48", "training.micro_batch_size=2",
                    "training.global_batch_size=2", f"training.run_dir={tmp_path / 'run'}",
                    f"data.cache_dir={tmp_path / 'cache'}", *extra]
    saved = measure_block(Trainer(load_config(TINY, over)), layer=1)
    assert saved.square == 0, "SDPA's CPU kernel is a flash kernel: no (S, S) probabilities saved"
    return saved.per_token, saved.weight_copies


SETTINGS = {
    "fp32_bf16plan": ["training.dtype=float32"],
    "fp32_nvfp4": ["training.dtype=float32", "precision.initial_plan=uniform:nvfp4"],
    "autocast_bf16plan": ["training.dtype=bfloat16"],
    "autocast_nvfp4": ["training.dtype=bfloat16", "precision.initial_plan=uniform:nvfp4"],
    "autocast_bf16plan_selective": ["training.dtype=bfloat16", "training.recompute=selective"],
    "fp32_selective": ["training.dtype=float32", "training.recompute=selective"],
    "fp32_full": ["training.dtype=float32", "training.recompute=full"],
    "autocast_nvfp4_full": ["training.dtype=bfloat16", "precision.initial_plan=uniform:nvfp4", "training.recompute=full"],
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_saved_bytes_per_token_per_block_match_the_estimate(tmp_path, name):
    got, weight_copies = measure(tmp_path, *SETTINGS[name])
    cfg = load_config(TINY, SMALL + ["model.ffn_hidden_size=80", "training.seq_len=48", *SETTINGS[name]])
    est = activation_bytes(cfg)
    assert got == est.per_token_block, (name, got, est)
    assert weight_copies == est.weight_copies_per_block, (name, weight_copies, est)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_recomputed_norm_and_swiglu_give_bitwise_the_saved_gradients(monkeypatch, dtype):
    """fp32 and BF16 autocast: losses and every gradient of a 2-block model, with the norms' and SwiGLU's
    intermediates recomputed (the code) and saved (recompute_cheap replaced by a plain call), are equal
    bit for bit - the accumulation order of the residual stream's gradient included."""
    from megatron_snip.model import llama, norm
    from megatron_snip.model.llama import LlamaModel

    cfg = load_config(TINY, SMALL).model
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(0))

    def grads():
        torch.manual_seed(0)
        model = LlamaModel(cfg, 320)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, recomputed = grads()
    for module in (llama, norm):
        monkeypatch.setattr(module, "recompute_cheap", lambda fn, *inputs: fn(*inputs))
    loss_saved, saved = grads()
    assert torch.equal(loss, loss_saved)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, saved, strict=True))


def test_a_math_attention_kernel_s_by_s_probabilities_are_counted_apart(tmp_path):
    """SDPA's math kernel (forced) saves (B, H, S, S) probabilities; the meter files them under
    ``square``, which flash attention (the estimate's assumption) does not have."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    over = SMALL + ["model.ffn_hidden_size=80", "training.seq_len=48", "training.micro_batch_size=2",
                    "training.global_batch_size=2", f"training.run_dir={tmp_path / 'run'}",
                    f"data.cache_dir={tmp_path / 'cache'}", "training.dtype=bfloat16"]
    with sdpa_kernel([SDPBackend.MATH]):
        saved = measure_block(Trainer(load_config(TINY, over)), layer=1)
    b, h, s = 2, 4, 48
    assert saved.square > 0 and saved.square % (b * h * s * s) == 0, saved
