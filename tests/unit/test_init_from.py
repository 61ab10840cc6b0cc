"""training.init_from: a new run from a Hugging Face directory or from one of our checkpoints, and
the export of what it trained back to transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_snip.config import load_config
from megatron_snip.training.export_hf import PLANS_FILE, export_checkpoint
from megatron_snip.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_hf
import make_tiny_hf
from hf_tolerance import logits_atol

TINY = "launch/configs/tiny.toml"
VOCAB = 512


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HF Llama (2 layers, d=64, ffn 128, 4/2 heads - the shape of conftest.SMALL) with a
    Llama-3-style tokenizer trained on the bundled sample."""
    from megatron_snip.data.corpus import bundled_sample_path, read_jsonl

    out = tmp_path_factory.mktemp("hf")
    tok = make_tiny_hf.llama3_style_tokenizer(read_jsonl(bundled_sample_path("sotu")), VOCAB)
    make_tiny_hf.save_tokenizer(tok, out, "llama3")
    make_tiny_hf.tiny_llama(VOCAB, ffn=128).save_pretrained(out)
    return out


def _hf_overrides(small_overrides, hf_dir, *extra):
    return [*small_overrides, "data.tokenizer=bpe", f"data.tokenizer_path={hf_dir / 'tokenizer.json'}",
            f"model.vocab_size={VOCAB}", "model.norm_eps=1e-5", f"training.init_from={hf_dir}", *extra]


def test_init_from_hf_then_export_round_trips_through_transformers(small_overrides, hf_dir, tmp_path):
    cfg = load_config(TINY, _hf_overrides(small_overrides, hf_dir, "training.max_steps=2"))
    tr = Trainer(cfg)
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(tr.model(x), ref(x).logits, atol=logits_atol(ref, x), rtol=0)
    assert tr.step == 0
    tr.fit()
    out = export_checkpoint(cfg.training.run_dir, tmp_path / "exported")
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (out / PLANS_FILE).is_file()
    with torch.no_grad():
        trained = tr.model.eval()(x)
        assert not torch.allclose(trained, ref(x).logits, atol=1e-3)  # training moved the weights
        torch.testing.assert_close(back(x).logits, trained, atol=logits_atol(back, x), rtol=0)


def test_init_from_hf_refuses_another_architecture(small_overrides, hf_dir):
    cfg = load_config(TINY, _hf_overrides(small_overrides, hf_dir, "model.ffn_hidden_size=64"))
    with pytest.raises(ValueError, match=r"training.init_from=.*model.ffn_hidden_size=64 but the checkpoint has 128.*"
                                         r"convert_hf.py config"):
        Trainer(cfg)
    cfg = load_config(TINY, _hf_overrides(small_overrides, hf_dir, "training.init_optimizer=true"))
    with pytest.raises(ValueError, match="training.init_optimizer=true but training.init_from=.* no optimizer state"):
        Trainer(cfg)


def _train(overrides, steps: int) -> Trainer:
    tr = Trainer(load_config(TINY, [*overrides, f"training.max_steps={steps}", "training.log_interval=1"]))
    tr.fit()
    return tr


def test_init_from_our_checkpoint_weights_and_optimizer(small_overrides, tmp_path):
    src = _train(small_overrides, 3)
    run_a = Path(src.cfg.training.run_dir)
    new = [*small_overrides[:-2], f"data.cache_dir={tmp_path / 'cache'}"]
    for i, source in enumerate((run_a, run_a / "checkpoints" / "step_000003")):
        run_b = tmp_path / f"b{i}"  # a new run each: a fresh run never reuses a run directory
        b = Trainer(load_config(TINY, [*new, f"training.run_dir={run_b}", f"training.init_from={source}",
                                       "training.init_optimizer=true"]))
        assert b.step == 0 and not (run_b / "checkpoints").exists()
        for (n, p), q in zip(b.model.named_parameters(), src.model.parameters()):
            assert torch.equal(p, q), n
            st_b, st_a = b.optimizer.state[p], src.optimizer.state[q]
            assert torch.equal(st_b["exp_avg"], st_a["exp_avg"]) and torch.equal(st_b["exp_avg_sq"], st_a["exp_avg_sq"])
        assert b.optimizer.param_groups[0]["weight_decay"] == b.cfg.training.weight_decay
    weights_only = Trainer(load_config(TINY, [*new, f"training.run_dir={tmp_path / 'b2'}", f"training.init_from={run_a}"]))
    assert not weights_only.optimizer.state  # fresh moments


def test_init_from_our_checkpoint_errors(small_overrides, tmp_path):
    src = _train(small_overrides, 1)
    run_a = src.cfg.training.run_dir
    new = [*small_overrides[:-2], f"training.run_dir={tmp_path / 'b'}", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ValueError, match=r"training.init_from='/nonexistent/run' does not exist"):
        Trainer(load_config(TINY, [*new, "training.init_from=/nonexistent/run"]))
    with pytest.raises(ValueError, match=r"training.init_from=.*no checkpoint there"):
        Trainer(load_config(TINY, [*new, f"training.init_from={tmp_path}"]))
    with pytest.raises(ValueError, match=r"model.hidden_size=128 but the checkpoint's run has 64"):
        Trainer(load_config(TINY, [*new, f"training.init_from={run_a}", "model.hidden_size=128"]))
    with pytest.raises(ValueError, match=r"parameter embedding.weight is \(320, 64\) .* but \(384, 64\).*model.vocab_size"):
        Trainer(load_config(TINY, [*new, f"training.init_from={run_a}", "model.vocab_size=384"]))
    with pytest.raises(ValueError, match="training.init_optimizer=True: needs training.init_from"):
        load_config(TINY, [*new, "training.init_optimizer=true"])


def test_convert_hf_config_writes_a_config_that_trains_from_the_checkpoint(hf_dir, tmp_path):
    out = tmp_path / "train.toml"
    assert convert_hf.main(["config", str(hf_dir), "--base", TINY, "--out", str(out), "--set", "training.seq_len=32",
                            "--set", f"training.run_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={tmp_path / 'c'}",
                            "--set", "data.valid_paths=[]", "--set", "training.progress=false"]) == 0
    cfg = load_config(out)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.vocab_size) == (2, 64, 128, VOCAB)
    assert cfg.data.tokenizer_path == str(hf_dir / "tokenizer.json") and cfg.training.init_from == str(hf_dir)
    tr = Trainer(cfg)  # the architecture check passes, the HF weights are loaded
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    assert torch.equal(tr.model.embedding.weight, ref.model.embed_tokens.weight)
    assert convert_hf.main(["config", str(hf_dir), "--out", str(out), "--set", "training.seq_len=1024"]) == 2
