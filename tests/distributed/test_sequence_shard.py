"""Sequence parallelism saves the local shard (parallel/sequence_shard.py), on TP=2 (2 gloo ranks).

Checked: (1) training is bitwise unchanged (the re-gathered input is the same bits, prefetched
or not), (2) the column-parallel linears keep (B, S/tp, K) shards instead of the (B, S, K)
gathered input, (3) the bytes one block saves for backward - those the outer
``saved_tensors_hooks`` sees plus the shards the inner hooks keep - equal
``sizing.activation_bytes``, as tests/unit/test_activation_memory.py checks without TP, and
(4) the re-gathers overlap backward: after forward every saved input is only its shard (no
gather started), and in backward each one but the first is prefetched when the one saved after
it is unpacked, so its unpack finds the all-gather already started; for the emulated and the
torch backend.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from megatron_snip.config import load_config
from megatron_snip.parallel import sequence_shard
from megatron_snip.parallel.distributed import init_distributed
from megatron_snip.sizing import activation_bytes
from megatron_snip.training.trainer import Trainer

TINY = "launch/configs/tiny.toml"
SHAPES = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96", "model.num_attention_heads=4",
          "model.num_kv_heads=2", "training.seq_len=40", "parallel.tp=2", "parallel.sequence_parallel=true"]
BASE = SHAPES + ["precision.compile_quantizers=false", "training.micro_batch_size=2", "training.global_batch_size=2",
                 "training.progress=false", "snip.enabled=false", "data.valid_paths=[]"]
SETTINGS = {"fp32": ["training.dtype=float32"], "autocast_bf16plan": ["training.dtype=bfloat16"],
            "autocast_nvfp4": ["training.dtype=bfloat16", "precision.initial_plan=uniform:nvfp4"],
            # The torch backend runs the same autograd function (on CPU with the emulated GEMM inside).
            "torch_autocast_fp8": ["training.dtype=bfloat16", "precision.backend=torch",
                                   "precision.initial_plan=uniform:fp8"]}


def _measure(tr: Trainer) -> tuple[float, list[tuple[int, ...]]]:
    """Bytes per token block 1 saves (one forward and backward), and the shapes of the shards kept."""
    block = tr.model.layers["1"]
    held = {p.untyped_storage().data_ptr() for p in tr.model.parameters()}
    weight_shapes = {tuple(p.shape) for p in block.parameters()} | {tuple(p.t().shape) for p in block.parameters()}
    saved: dict[int, int] = {}
    shards: list[tuple[int, ...]] = []
    inside = [False]  # in block 1's forward

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in held and tuple(t.shape) not in weight_shapes:
            saved[st.data_ptr()] = st.nbytes()
        return t

    real_forward, real_init = block.forward, sequence_shard.SequenceShard.__init__

    def forward(*args):
        inside[0] = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return real_forward(*args)
        finally:
            inside[0] = False

    def init(self, shard, *rest, **kw):  # the inner hooks' kept tensors, which the outer hook never sees
        real_init(self, shard, *rest, **kw)
        if inside[0]:
            shards.append(tuple(shard.shape))
            saved[shard.untyped_storage().data_ptr()] = shard.untyped_storage().nbytes()

    block.forward, sequence_shard.SequenceShard.__init__ = forward, init
    try:
        tokens = tr.micro_batches(0)[0]
        cos, sin = tr.model._rope(tokens.shape[1] - 1, tr.device)
        held.update({cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()})
        with tr._autocast():
            out = tr.model(tokens[:, :-1])
        tr.model.loss(out, tokens[:, 1:]).backward()
    finally:
        block.forward, sequence_shard.SequenceShard.__init__ = real_forward, real_init
    return sum(saved.values()) / (tokens.shape[0] * (tokens.shape[1] - 1)), shards


def _prefetch_trace(tr: Trainer) -> dict:
    """One forward and backward of the whole stage: what the saved shards hold after forward, and
    backward's sequence of ``("prefetch", i)`` and ``("gather", i, waited on a prefetch)`` over the
    shards i in the order forward saved them."""
    shards: list[sequence_shard.SequenceShard] = []
    events: list[tuple] = []
    cls = sequence_shard.SequenceShard
    real_init, real_prefetch, real_gather = cls.__init__, cls.prefetch, cls.gather

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        shards.append(self)

    def prefetch(self):
        events.append(("prefetch", shards.index(self)))
        real_prefetch(self)

    def gather(self):
        full = real_gather(self)
        events.append(("gather", shards.index(self), self.prefetched))
        return full

    cls.__init__, cls.prefetch, cls.gather = init, prefetch, gather
    try:
        tokens = tr.micro_batches(0)[0]
        with tr._autocast():
            out = tr.model(tokens[:, :-1])
        after_forward = [(s.pending is None, s.used) for s in shards]
        tr.model.loss(out, tokens[:, 1:]).backward()
    finally:
        cls.__init__, cls.prefetch, cls.gather = real_init, real_prefetch, real_gather
    tr.optimizer.zero_grad(set_to_none=True)
    return {"after_forward": after_forward, "events": events}


def _worker(rank: int, world: int, run_dir: str) -> dict:
    topo = init_distributed(2, 1, device_type="cpu", timeout_s=90)
    out = {}
    for name, extra in SETTINGS.items():
        losses = {}
        for on in (False, True):
            tr = Trainer(load_config(TINY, BASE + extra + [f"training.run_dir={run_dir}/{name}{on}",
                                                           f"data.cache_dir={run_dir}/cache"]), topo)
            for lin in (b for blk in tr.model.layers.values() for b in (blk.attn.qkv, blk.mlp.fc1)):
                lin.save_input_shard = on
            out[f"{name}_{'shard' if on else 'gathered'}"] = _measure(tr)  # both: same stochastic-rounding draws
            tr.optimizer.zero_grad(set_to_none=True)
            out[f"{name}_{'shard' if on else 'gathered'}_trace"] = _prefetch_trace(tr)
            losses[on] = [tr.train_step(s).loss for s in range(2)]
            tr.logger.close()
        out[f"{name}_losses"] = losses
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, 2, args=(str(tmp_path_factory.mktemp("sp")),), timeout_s=240)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sp_saves_the_shard_and_matches_the_estimate(results, name):
    for r in results:
        assert r[f"{name}_losses"][True] == r[f"{name}_losses"][False], "bitwise unchanged training"
        per_token, shards = r[f"{name}_shard"]
        assert shards == [(2, 20, 64)] * 2, "qkv and fc1 keep their (B, S/tp, D) input shard"
        gathered, none = r[f"{name}_gathered"]
        assert none == [] and gathered > per_token
        est = activation_bytes(load_config(TINY, SHAPES + SETTINGS[name]))
        assert per_token == est.stored, (name, per_token, est)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sp_regathers_are_prefetched_during_backward(results, name):
    for r in results:
        trace = r[f"{name}_shard_trace"]
        # qkv and fc1 of 2 blocks; after forward each holds only its shard: no gather started or used.
        assert trace["after_forward"] == [(True, False)] * 4
        # Backward unpacks them last-saved first; each unpack starts the next one's all-gather
        # (after its own), so every unpack but the first waits on a gather already under way.
        assert trace["events"] == [("gather", 3, False), ("prefetch", 2), ("gather", 2, True), ("prefetch", 1),
                                   ("gather", 1, True), ("prefetch", 0), ("gather", 0, True)]
        assert r[f"{name}_gathered_trace"] == {"after_forward": [], "events": []}, "without shards: no chain"
