"""Issue #24 benchmarks: compiled blocks, the re-plan's cost, host syncs per step.

    python -m experiments.bench.throughput --rounds 5 > docs/bench/throughput.txt

All in one process, one torch thread, on ``--config`` (default tiny: 4 layers, d=256, micro-batch
8 x 256 tokens, fp32 on CPU, SNIP off for the step timings):

(a) Compiled BF16 step vs an eager Hugging Face ``LlamaForCausalLM`` of the same shape, batch and
    AdamW (lr, betas, eps, weight decay, clip at 1.0): rotating rounds, each timing one step of
    every contestant, so all see the same machine load; reported: the median over rounds of
    (our step / HF step of the same round), and the ratio of the fastest steps. "ours eager" (training.compile=false) is timed in
    the same rounds for reference. Target <= 0.85.
(b) Compiled emulated NVFP4 step (uniform plan) vs compiled BF16 step, from the same rounds.
    Target <= 1.15.
(c) Re-plan cost in micro-batch passes: what a re-plan step costs beyond a BF16 step, i.e. one
    ``SnipController.replan`` (statistics + metrics + solve + apply) plus that step's training step
    (which, with ``snip.reuse_step``, takes the gradients of its micro-batches that were probe
    batches from the statistics' reference pass) minus a BF16 step, against one micro-batch
    forward+backward (a BF16 step's time divided by its micro-batches); medians over ``--replans``
    re-plans after one untimed one, with the parts of the statistics. Also the re-plan alone
    (without the step it saves). ``--shapes comparison`` measures at the comparison model's shapes
    (``experiments.comparison.protocol.DEFAULT_SETS``, reuse on). Target <= 6.
(d) Host syncs per step: ``telemetry.host_syncs.count_host_syncs`` around ``Trainer.fit`` over
    ``--sync-steps`` steps with ``log_interval`` = that many, per step outside the read step,
    for the CPU optimizer (foreach AdamW: its skip is read on the host, 1 per step) and for
    torch's fused AdamW (the CUDA optimizer: it skips on the device, 0). Target 0.

Every contestant runs ``--warmup`` untimed steps first (compilation, allocator warm-up). Wall
clock on a possibly shared machine: the load average is printed; ratios from the same rounds
are meaningful under load, absolute times are not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from experiments.bench.common import build_trainer, machine, uniform_plan
from experiments.comparison.protocol import DEFAULT_SETS
from megatron_snip.config import load_config
from megatron_snip.precision import gemm as gemm_module


def _hf_stepper(cfg, vocab_size: int, micro: list[torch.Tensor]):
    """A step of an eager HF LlamaForCausalLM shaped like ``cfg.model`` on ``micro``: the same
    loss (mean cross entropy of every next token, in fp32), clip and AdamW as our step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m, t = cfg.model, cfg.training
    hf_cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_kv_heads, max_position_embeddings=m.max_position_embeddings,
                         rms_norm_eps=m.norm_eps, rope_theta=m.rope_base, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                            weight_decay=t.weight_decay, foreach=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for tokens in micro:
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
            (loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        opt.step()

    return step


def _ours_stepper(trainer, fmt: str):
    plan = uniform_plan(trainer, fmt)
    state = {"step": 0}

    def step() -> None:
        trainer.apply_plan(plan)
        res = trainer.train_step(state["step"])
        state["step"] += 1
        assert not res.skipped

    return step


def measure_rounds(steppers: dict, warmup: int, rounds: int) -> dict[str, list[float]]:
    for name, fn in steppers.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f}s for {warmup} steps", flush=True)
    times: dict[str, list[float]] = {n: [] for n in steppers}
    names = list(steppers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            steppers[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def host_syncs_per_step(cfg_path: str, overrides: list[str], steps: int, fused: bool) -> list[int]:
    """(d): megatron_snip's host reads per step (train_step plus the loop's work after it)."""
    from megatron_snip.telemetry.host_syncs import count_host_syncs
    from megatron_snip.training import trainer as trainer_mod

    over = overrides + [f"training.max_steps={steps}", f"training.log_interval={steps}",
                        "training.eval_interval=100000", "training.save_interval=0"]
    cfg = load_config(cfg_path, over)
    real_build = trainer_mod.build_optimizer
    if fused:
        def build(model, t, device, topo):
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                      for g in real_build(model, t, device, topo).param_groups]
            return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, fused=True)
        trainer_mod.build_optimizer = build
    try:
        tr = build_trainer(cfg)
    finally:
        trainer_mod.build_optimizer = real_build
    marks: list[int] = []
    per_step: list[int] = []
    real_step = type(tr).train_step
    with count_host_syncs() as syncs:
        def counted(s):
            if marks:
                per_step.append(syncs.count - marks[-1])
            marks.append(syncs.count)
            return real_step(tr, s)
        tr.train_step = counted
        tr.fit()
    tr.logger.close()
    return per_step  # steps 0 .. steps-2, each from its start to the next step's start


def replan_passes(trainer, cfg, reps: int) -> dict:
    """(c): (re-plan + its step - a BF16 step) / one micro-batch forward+backward (BF16)."""
    from megatron_snip.snip.controller import SnipController

    ctl = SnipController(cfg, trainer)
    bf16 = uniform_plan(trainer, "bf16")
    step = 1000

    def replan_step() -> tuple[float, float, object]:
        """A re-plan from the BF16 plan and its step: (re-plan s, step s, the Replan)."""
        nonlocal step
        trainer.apply_plan(bf16)
        t0 = time.perf_counter()
        replan = ctl.replan(trainer, step)
        t1 = time.perf_counter()
        trainer.train_step(step)
        t2 = time.perf_counter()
        step += 1
        return t1 - t0, t2 - t1, replan

    replan_step()  # pays one-off costs (compiled quantizers for the statistics' shapes)
    replans, extra, steps, timings, reused = [], [], [], [], 0
    for _ in range(reps):
        trainer.apply_plan(bf16)
        t0 = time.perf_counter()
        trainer.train_step(step)
        steps.append(time.perf_counter() - t0)
        step += 1
        dt, dstep, replan = replan_step()
        replans.append(dt)
        extra.append(dt + dstep - steps[-1])
        timings.append(replan.timings)
        reused = replan.reused_micro_batches
    per_pass = statistics.median(steps) / trainer.micro_batches_per_step
    return {"replan_s": statistics.median(replans), "micro_batch_pass_s": per_pass,
            "passes": statistics.median(extra) / per_pass, "replan_alone_passes": statistics.median(replans) / per_pass,
            "reused": reused, "micro_batches": trainer.micro_batches_per_step, "timings": timings[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="launch/configs/tiny.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--replans", type=int, default=2)
    ap.add_argument("--sync-steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: ab,c,d")
    ap.add_argument("--shapes", default="config", choices=["config", "comparison"],
                    help="(c) at --config's shapes, or at the policy comparison's model (8 blocks, d=128)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gemm_module.tune_cpu_malloc()
    skip = set(filter(None, args.skip.split(",")))
    print(f"# python -m experiments.bench.throughput {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# machine: {machine()}")
    tmp = tempfile.mkdtemp(prefix="bench_throughput_")
    base = ["snip.enabled=false", "training.progress=false", "training.max_steps=100000", *args.set]

    def trainer(name: str, *extra: str):
        return build_trainer(load_config(args.config, base + [f"training.run_dir={tmp}/{name}", *extra]))

    if "ab" not in skip:
        eager = trainer("eager", "training.compile=false", "precision.compile_quantizers=true")
        comp = trainer("compiled", "training.compile=true", "precision.compile_quantizers=true")
        micro = eager.micro_batches(0)
        steppers = {"hf_eager": _hf_stepper(eager.cfg, eager.vocab_size, micro), "ours_eager_bf16": _ours_stepper(eager, "bf16"),
                    "ours_compiled_bf16": _ours_stepper(comp, "bf16"),
                    "ours_compiled_nvfp4": _ours_stepper(comp, "nvfp4"),
                    "ours_eager_nvfp4": _ours_stepper(eager, "nvfp4")}
        times = measure_rounds(steppers, args.warmup, args.rounds)
        print("\nstep times (median s over rounds):")
        for name, ts in times.items():
            print(f"  {name:22s} {statistics.median(ts):.3f}  (min {min(ts):.3f})")
        mins = {n: min(ts) for n, ts in times.items()}
        print("ratios of the fastest steps (the least disturbed on a loaded machine): "
              f"compiled BF16 / HF {mins['ours_compiled_bf16'] / mins['hf_eager']:.3f}, "
              f"eager BF16 / HF {mins['ours_eager_bf16'] / mins['hf_eager']:.3f}, "
              f"compiled NVFP4 / compiled BF16 {mins['ours_compiled_nvfp4'] / mins['ours_compiled_bf16']:.3f}")
        print(f"(a) compiled BF16 / HF eager:        {ratio(times, 'ours_compiled_bf16', 'hf_eager'):.3f}  "
              f"(target <= 0.85; ours eager BF16 / HF eager: {ratio(times, 'ours_eager_bf16', 'hf_eager'):.3f})")
        print(f"(b) compiled NVFP4 / compiled BF16:  {ratio(times, 'ours_compiled_nvfp4', 'ours_compiled_bf16'):.3f}  "
              f"(target <= 1.15; eager blocks: {ratio(times, 'ours_eager_nvfp4', 'ours_eager_bf16'):.3f})")
    if "c" not in skip:
        shapes = [] if args.shapes == "config" else [o for o in DEFAULT_SETS if not o.startswith("snip.reuse_step")]
        cfg = load_config(args.config, [o for o in base if o != "snip.enabled=false"] + shapes
                          + [f"training.run_dir={tmp}/replan", "snip.enabled=true"])
        r = replan_passes(build_trainer(cfg), cfg, args.replans)
        print(f"(c) re-plan step at {args.shapes} shapes (snip.reuse_step={str(cfg.snip.reuse_step).lower()}, "
              f"{r['reused']} of {r['micro_batches']} micro-batches reused): "
              f"{r['passes']:.1f} micro-batch passes beyond a BF16 step (target <= 6); the re-plan alone "
              f"{r['replan_s']:.2f}s = {r['replan_alone_passes']:.1f} passes (one pass {r['micro_batch_pass_s']:.3f}s); "
              "parts: " + ", ".join(f"{k}={v:.2f}" for k, v in r["timings"].items()))
    if "d" not in skip:
        for fused in (False, True):
            counts = host_syncs_per_step(args.config, base + [f"training.run_dir={tmp}/syncs{int(fused)}"],
                                         args.sync_steps, fused)
            name = "fused AdamW (CUDA's)" if fused else "foreach AdamW (CPU's)"
            print(f"(d) host syncs per step, {name}: {counts} (target 0 between log steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
