"""Rerun issue #36's list of inputs and faults as a user would (real CLI processes), and count
each outcome as clean / vague / bad.

    PYTHONPATH=$PWD python3 experiments/rerun_issue36.py [--out DIR]

clean: the expected exit code, no traceback, and every word the case needs (the field or file,
the value, the fix; or, for an accepted input, what it was read as). vague: the exit code is
right and there is no traceback, but words are missing. bad: a traceback, or the wrong exit code.
Prints one line per case and the counts; the cases and their words are the table ``CASES``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = "launch/configs/tiny.toml"
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "training.seq_len=32", "training.micro_batch_size=4", "training.global_batch_size=4",
         "training.warmup_steps=2", "training.eval_batches=2", "training.progress=false", "snip.enabled=false",
         "data.valid_paths=[]", "precision.compile_quantizers=false"]

SLOW_EVAL = """
import os, signal, sys, time
from megatron_snip import train
from megatron_snip.training.trainer import Trainer
real, sent = Trainer.evaluate_batch, []
def slow(self, tokens):
    if not sent:
        sent.append(1); os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3)
    return real(self, tokens)
Trainer.evaluate_batch = slow
sys.exit(train.main(sys.argv[1:]))
"""

SLOW_SAVE = """
import sys, time
from megatron_snip import train
from megatron_snip.training import checkpoint as ckpt
real = ckpt.write_shard
def slow(root, step, state, *a, **k):
    out = real(root, step, state, *a, **k)
    if step == 4:
        print("saving", flush=True); time.sleep(60)
    return out
ckpt.write_shard = slow
sys.exit(train.main(sys.argv[1:]))
"""


def run(argv: list[str], signal_on: str | None = None) -> tuple[int, str]:
    """(exit code, stdout + stderr) of ``argv`` run from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = ""
    if signal_on is not None:
        for line in proc.stdout:
            seen += line
            if signal_on in line:
                proc.send_signal(signal.SIGTERM)
                break
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, seen + out


def train(tmp: Path, *extra: str, code: str | None = None, signal_on: str | None = None) -> tuple[int, str]:
    over = SMALL + [f"data.cache_dir={tmp / 'cache'}", *extra]
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "megatron_snip.train"]
    return run([*head, "--config", TINY, *[a for o in over for a in ("--set", o)]], signal_on)


def nan_weights(run_dir: Path, step: int, fix_checksum: bool) -> Path:
    import torch

    from megatron_snip.training import checkpoint as ckpt

    d = ckpt.step_dir(run_dir / "checkpoints", step)
    shard = d / ckpt.shard_name()
    state = torch.load(shard, weights_only=True)
    state["model"]["layers.0.mlp.fc1.weight"][0, 0] = float("nan")
    torch.save(state, shard)
    if fix_checksum:
        meta = json.loads((d / "meta.json").read_text())
        meta["shards"][shard.name] = ckpt.file_sha256(shard)
        (d / "meta.json").write_text(json.dumps(meta))
    return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="working directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    tmp = Path(args.out or tempfile.mkdtemp(prefix="rerun36_"))
    tmp.mkdir(parents=True, exist_ok=True)
    import numpy as np

    from megatron_snip.data import indexed

    pristine = tmp / "pristine"
    rc, out = train(tmp, f"training.run_dir={pristine}", "training.max_steps=4", "training.save_interval=2",
                    "training.eval_interval=100")
    assert rc == 0, out

    def copy(name: str) -> Path:
        dst = tmp / name
        shutil.copytree(pristine, dst)
        return dst

    ev = [sys.executable, "-m", "megatron_snip.evaluate"]
    moby = ["--valid-corpus", "moby=bundled:moby_dick", "--max-sequences", "4", "--no-held-out"]
    hf = [sys.executable, "scripts/convert_hf.py", "export"]
    small = tmp / "short.jsonl"
    small.write_text(json.dumps({"text": "hi"}) + "\n")
    few = tmp / "few.jsonl"
    few.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    rng = np.random.default_rng(0)
    with indexed.IndexedDatasetBuilder(tmp / "big", np.uint16) as b:
        for _ in range(320):
            b.add_document(rng.integers(32, 127, 4096).astype(np.uint16))
    big = str(tmp / "big")
    nofp = tmp / "nofp"
    sidecars = [e for e in (".bin.sha256",) if os.path.exists(big + e)]  # older code writes none
    for ext in (".bin", ".idx", *sidecars):
        shutil.copyfile(big + ext, str(nofp) + ext)
    mid = tmp / "mid"
    for ext in (".bin", ".idx", ".idx.fingerprint", *sidecars):
        shutil.copyfile(big + ext, str(mid) + ext)
    with open(str(mid) + ".bin", "r+b") as f:
        f.seek(os.path.getsize(str(mid) + ".bin") // 2)
        f.write(b"\x41\x00")
    hfdir = tmp / "hf_noconfig"
    hfdir.mkdir()
    (hfdir / "model.safetensors").write_bytes(b"")

    cases = []  # (name, thunk -> (rc, text), expected rc, words that must appear, words that must not)

    def case(name, thunk, rc, words, absent=()):
        cases.append((name, thunk, rc, words, absent))

    r = copy("r1")
    case("evaluate: checksum-failing newest shard (run dir)", lambda: (nan_weights(r, 4, False), run([*ev, "--checkpoint", str(r), *moby]))[1],
         0, ["(step 2, the newest that verifies); skipped 1 newer", "shard_tp00_pp00.pt is corrupt"], ["loss nan"])
    r2 = copy("r2")
    case("evaluate: checksum-failing named step dir", lambda: (d := nan_weights(r2, 4, False), run([*ev, "--checkpoint", str(d), *moby]))[1],
         2, ["error: --checkpoint=", "shard_tp00_pp00.pt is corrupt", "the newest checkpoint of the run that verifies"])
    r3 = copy("r3")
    case("evaluate: NaN weights, checksum matching", lambda: (d := nan_weights(r3, 4, True), run([*ev, "--checkpoint", str(d), *moby]))[1],
         2, ["tensor layers.0.mlp.fc1.weight (256, 64) holds 1 non-finite", "use an older checkpoint"])
    r4 = copy("r4")
    case("export: NaN checkpoint", lambda: (d := nan_weights(r4, 4, True), run([*hf, str(d), "--out", str(tmp / "hf4")]))[1],
         2, ["tensor layers.0.mlp.fc1.weight", "non-finite"])
    r5 = copy("r5")
    case("export: checksum-failing shard", lambda: (d := nan_weights(r5, 4, False), run([*hf, str(d), "--out", str(tmp / "hf5")]))[1],
         2, ["shard_tp00_pp00.pt is corrupt"])
    r6 = copy("r6")
    case("init_from: checksum-failing shard", lambda: (d := nan_weights(r6, 4, False), train(tmp, f"training.run_dir={tmp / 'n6'}", f"training.init_from={d}", "training.max_steps=2"))[1],
         2, ["config training.init_from", "shard_tp00_pp00.pt is corrupt"])
    r7 = copy("r7")
    case("init_from: NaN source (checksum matching)", lambda: (d := nan_weights(r7, 4, True), train(tmp, f"training.run_dir={tmp / 'n7'}", f"training.init_from={d}", "training.max_steps=2"))[1],
         2, ["config training.init_from", "tensor layers.0.mlp.fc1.weight"], ["Lower training.lr"])
    case("evaluate: the result names the step dir", lambda: run([*ev, "--checkpoint", str(pristine), *moby, "--out", str(tmp / "e.json")]),
         0, [f"checkpoint {pristine / 'checkpoints' / 'step_000004'} step 4"])
    case("evaluate: --out unwritable", lambda: run([*ev, "--checkpoint", str(pristine), *moby, "--out", "/proc/x/e.json"]),
         2, ["error: --out '/proc/x/e.json'", "not writable", "choose another --out"], ["loss "])
    case("evaluate: --out a directory", lambda: run([*ev, "--checkpoint", str(pristine), *moby, "--out", str(tmp)]),
         2, [f"error: --out '{tmp}' is a directory, not a file"], ["loss "])
    tb_file = tmp / "tb_file"
    case("tensorboard: <run_dir>/tensorboard is a file",
         lambda: (tb_file.mkdir(), (tb_file / "tensorboard").write_text("x"), train(tmp, f"training.run_dir={tb_file}", "logging.tensorboard=true", "training.max_steps=1"))[2],
         2, ["config logging.tensorboard=true", "is a file, not a directory", "or set logging.tensorboard=false"])
    tb_ro = tmp / "tb_ro"
    case("tensorboard: <run_dir>/tensorboard unwritable",
         lambda: (tb_ro.mkdir(), (tb_ro / "tensorboard").symlink_to("/proc"), train(tmp, f"training.run_dir={tb_ro}", "logging.tensorboard=true", "training.max_steps=1"))[2],
         2, ["config logging.tensorboard=true", "is not a writable directory", "or set logging.tensorboard=false"])
    for v in ("[]", "{}"):
        case(f"data.train_path={v}", lambda v=v: train(tmp, f"training.run_dir={tmp / 'e'}", f"data.train_path={v}"),
             2, ["config data.train_path=[]", "give a corpus"], ["IndexError"])
    case("init_from_ignore_unused without init_from", lambda: train(tmp, f"training.run_dir={tmp / 'e'}", "training.init_from_ignore_unused=true"),
         2, ["config training.init_from_ignore_unused=True", "needs training.init_from"])
    case("preemption: SIGTERM during an eval longer than the grace",
         lambda: train(tmp, f"training.run_dir={tmp / 'p1'}", "training.max_steps=8", "training.eval_interval=2",
                       "training.preempt_grace_s=5", 'data.valid_paths=["bundled:moby_dick"]', code=SLOW_EVAL),
         75, ["stopped after step 2: checkpoint", "step_000002 written; its evaluation was aborted"], ["between step boundaries"])
    p2 = tmp / "p2"
    def interrupted_save_then_restart() -> tuple[int, str]:
        over = (f"training.run_dir={p2}", "training.max_steps=6", "training.save_interval=2", "training.eval_interval=100")
        rc, first = train(tmp, *over, "training.preempt_grace_s=1", code=SLOW_SAVE, signal_on="saving")
        if rc != 128 + signal.SIGTERM:
            return rc, first
        rc, second = train(tmp, *over, "training.resume=auto")
        return rc, first + second

    case("preemption: grace deadline during a save (message), then the next start cleans the temp dir",
         interrupted_save_then_restart,
         0, ["The checkpoint of step 4 was being written and is not committed", "removed ", ".tmp_step_000004 (",
             "interrupted before its commit"], ["between step boundaries"])
    case("preemption: steps counted from 1",
         lambda: train(tmp, f"training.run_dir={tmp / 'p3'}", "training.max_steps=8", "training.eval_interval=2",
                       "training.preempt_grace_s=5", 'data.valid_paths=["bundled:moby_dick"]', code=SLOW_EVAL),
         75, ["stopped after step 2: checkpoint", "step_000002"], ["stopped after step 1:"])
    case("too little text: a blend source", lambda: train(tmp, f"training.run_dir={tmp / 'e'}", f'data.train_path=["0.5", "bundled:sotu", "0.5", "{few}"]'),
         2, [f"config data.train_path source '{few}' (", ".bin): the selected"])
    case("too little text: --valid-corpus", lambda: run([*ev, "--checkpoint", str(pristine), "--no-held-out", "--valid-corpus", f"short={small}"]),
         2, [f"--valid-corpus short={small} (", ".bin): the selected 1 documents"])
    case("Megatron's blend string", lambda: train(tmp, f"training.run_dir={tmp / 'b1'}", "data.train_path=0.7 bundled:sotu 0.3 bundled:moby_dick", "training.max_steps=1"),
         0, ["val_loss_sotu", "val_loss_moby_dick"])
    case("bracketless blend", lambda: train(tmp, f"training.run_dir={tmp / 'e'}", "data.train_path=0.7,bundled:sotu,0.3,bundled:moby_dick"),
         2, ["config data.train_path '0.7,bundled:sotu,0.3,bundled:moby_dick'", "a blend is a list"])
    case("data.train_path=<prefix>.bin", lambda: train(tmp, f"training.run_dir={tmp / 'b2'}", f"data.train_path={big}.bin", "training.max_steps=1"),
         0, [f"names a file of the indexed prefix '{big}'"])
    case("HF directory without config.json", lambda: train(tmp, f"training.run_dir={tmp / 'e'}", f"training.init_from={hfdir}"),
         2, ["looks like a Hugging Face model directory", "has no config.json"])
    case("export of a byte-tokenizer run", lambda: run([*hf, str(pristine), "--out", str(tmp / "hf_byte")]),
         0, ["data.tokenizer='byte'", "lm_eval"])
    case("suite: test_launch via a `..` interpreter path",
         lambda: run([os.path.relpath(os.path.realpath(sys.executable), ROOT), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "tests/unit/test_launch.py"]),
         0, ["passed"], ["failed"])
    case(".idx without the fingerprint sidecar: said at load time",
         lambda: (os.remove(str(nofp) + ".idx.fingerprint") if os.path.exists(str(nofp) + ".idx.fingerprint") else None,
                  train(tmp, f"training.run_dir={tmp / 'f1'}", f"data.train_path={nofp}", "training.max_steps=1"))[1],
         0, [f"{nofp}.idx has no fingerprint sidecar", "data.verify_full_hash=true"])
    def middle_changed() -> tuple[int, str]:
        rc, first = train(tmp, f"training.run_dir={tmp / 'f2'}", f"data.train_path={mid}", "training.max_steps=1")
        if rc != 0:
            return rc, first
        rc, second = train(tmp, f"training.run_dir={tmp / 'f3'}", f"data.train_path={mid}", "data.verify_full_hash=true")
        return rc, first + second

    case(".bin changed in its middle: said, and data.verify_full_hash refuses it", middle_changed,
         2, ["a change only between those is not detected", f"{mid}.bin has sha256", "the file changed after it was recorded"])

    counts = {"clean": 0, "vague": 0, "bad": 0}
    for name, thunk, want_rc, words, absent in cases:
        t0 = time.monotonic()
        rc, text = thunk()
        missing = [w for w in words if w not in text] + [f"(unwanted) {w}" for w in absent if w in text]
        if "Traceback" in text or rc != want_rc:
            verdict = "bad"
        else:
            verdict = "vague" if missing else "clean"
        counts[verdict] += 1
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
        print(f"{verdict:5s} rc={rc:<3d} ({time.monotonic() - t0:5.1f} s) {name}" +
              (f"\n      missing: {missing}\n      last line: {last[0][:300]}" if verdict != "clean" else ""), flush=True)
    print(f"{len(cases)} cases: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    if args.out is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if counts["clean"] == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
