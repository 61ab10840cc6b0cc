"""Quantizer fallbacks: a compile that fails once (another process's half-written artifact in a
shared inductor cache) is retried in a private cache; one that keeps failing runs eager, with
its cause recorded once and written to the run's text log. CPU; no real compilation (the
compiler is replaced by stand-ins that fail as inductor did)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from megatron_snip.precision import fallbacks
from megatron_snip.precision.formats import Operand
from megatron_snip.precision.quantize import compiled, quantize

RACE = ImportError("/tmp/torchinductor/ab/cabc.main.so: file too short")


@pytest.fixture
def fresh_compile_state(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled, "_COMPILE_ERROR", [])
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(fallbacks, "_RECORDED", {})
    monkeypatch.setattr(fallbacks, "_UNLOGGED", [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    return tmp_path


def _compiler(failures: list[BaseException], seen_dirs: list[str]):
    """A stand-in for _get_compiled: raises the queued failures, then runs the eager math."""
    def get(spec, operand, hadamard, colwise, p, amax, seeds):
        def run(p_, amax_, seeds_):
            seen_dirs.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
            if failures:
                raise failures.pop(0)
            return compiled._qdq(p_, spec, operand, hadamard, colwise, amax_, seeds_)
        return run
    return get


def test_compile_race_is_retried_in_a_private_cache(fresh_compile_state, monkeypatch):
    dirs: list[str] = []
    monkeypatch.setattr(compiled, "_get_compiled", _compiler([RACE], dirs))
    x = torch.randn(32, 64)
    y = quantize(x, "mxfp8", Operand.ACTIVATION, compiled=True)
    assert torch.equal(y, quantize(x, "mxfp8", Operand.ACTIVATION))
    assert compiled.compiled_quantizers_available() == (True, "")
    shared = str(fresh_compile_state / "shared")
    assert dirs[0] == shared and dirs[1].startswith(os.path.join(shared, "private-")) and os.path.isdir(dirs[1])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == dirs[1]  # later compiles stay out of the shared cache
    assert fallbacks.drain() == []


def test_repeated_compile_failure_runs_eager_and_says_why_once(fresh_compile_state, monkeypatch):
    monkeypatch.setattr(compiled, "_get_compiled", _compiler([RACE, RACE], []))
    x = torch.randn(32, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = quantize(x, "nvfp4", Operand.ACTIVATION, compiled=True)
        quantize(x, "nvfp4", Operand.ACTIVATION, compiled=True)  # eager from now on, no new warning
    assert torch.equal(y, quantize(x, "nvfp4", Operand.ACTIVATION))
    ok, reason = compiled.compiled_quantizers_available()
    assert not ok and reason.count("file too short") == 2 and "retried in the private cache" in reason
    assert len([w for w in caught if "torch.compile of the quantizers failed" in str(w.message)]) == 1
    lines = fallbacks.drain()
    assert len(lines) == 1 and "file too short" in lines[0] and fallbacks.drain() == []


def test_trainer_writes_fallbacks_to_its_text_log(fresh_compile_state, monkeypatch, small_overrides, capsys):
    from megatron_snip.config import load_config
    from megatron_snip.training.trainer import Trainer

    monkeypatch.setattr(compiled, "_get_compiled", _compiler([RACE] * 2, []))
    cfg = load_config("launch/configs/tiny.toml", small_overrides + [
        "precision.compile_quantizers=true", "precision.initial_plan=uniform:mxfp8", "training.max_steps=2"])
    tr = Trainer(cfg)
    tr.fit()
    tr.logger.close()
    out = capsys.readouterr().out
    assert out.count("fallback: torch.compile of the quantizers failed") == 1 and "file too short" in out
