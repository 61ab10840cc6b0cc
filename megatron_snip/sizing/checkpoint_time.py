"""The dry run's checkpoint line (issue #36 item 4): the bytes each writing rank saves and the time
``training.async_save`` hides.

A shard (``Trainer.state_dict``, written by DP rank 0 of each (TP, PP) shard) holds the rank's fp32
master weights and both AdamW moments - 12 B per parameter, ZeRO-1 or not (the distributed optimizer
gathers its DP shards onto DP rank 0 for the save) - plus kilobytes of RNG, plan and counters. The
write time is those bytes over a disk bandwidth per writing rank, an assumed figure:
``CKPT_WRITE_GBPS`` = 1 GB/s, i.e. about 8 GB/s per node of eight GPUs writing at once, what a
shared parallel filesystem commonly sustains per client node (far below a node's storage links,
so the filesystem, not the link, is the limit). It is not measured here: set
``$MEGATRON_SNIP_CKPT_WRITE_GBPS`` to your own (``dd``/``fio`` with direct, fsynced writes of a few GB).
The synchronous save stalls every rank for that write plus its sha256 pass over the file; the
asynchronous one stalls only for the device-to-host copy of the same bytes into pinned memory.
tests/unit/test_sizing.py checks the byte count against a real shard.
"""

from __future__ import annotations

import os

from megatron_snip.sizing.result import ADAM_BYTES, WEIGHT_BYTES, Sizing

CKPT_WRITE_GBPS = 1.0  # GB/s per writing rank (module docstring): an assumption, not a measurement
CKPT_WRITE_ENV = "MEGATRON_SNIP_CKPT_WRITE_GBPS"


def write_gbps() -> tuple[float, str]:
    """The disk bandwidth per writing rank (GB/s) and where it came from."""
    raw = os.environ.get(CKPT_WRITE_ENV, "")
    if not raw:
        return CKPT_WRITE_GBPS, f"assumed; set ${CKPT_WRITE_ENV}"
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${CKPT_WRITE_ENV}={raw!r} is not a bandwidth; give GB/s per writing rank, e.g. 2.5")
    return value, f"${CKPT_WRITE_ENV}"


def shard_bytes(s: Sizing) -> int:
    """Bytes of the largest checkpoint shard one rank writes (fp32 weights + AdamW m, v)."""
    return max(st.params for st in s.stages) * (WEIGHT_BYTES + ADAM_BYTES)


def checkpoint_lines(s: Sizing) -> list[str]:
    """``checkpoint  <GiB> per writing rank ...``: the save's size and the write time async_save hides."""
    gbps, src = write_gbps()
    n = shard_bytes(s)
    writers = s.tp * s.pp
    seconds = n / (gbps * 1e9)
    line = (f"checkpoint  {n / 2**30:.2f} GiB per writing rank ({WEIGHT_BYTES + ADAM_BYTES} B/param: fp32 weights + "
            f"AdamW m, v; {writers} writing ranks = TP x PP, {n * writers / 2**30:.1f} GiB per save); at "
            f"{gbps:g} GB/s per writer ({src}) a synchronous save stalls {seconds:.1f} s + its sha256 pass; "
            f"training.async_save hides that, stalling only for the copy to pinned host memory")
    return [line]
