"""HF directory I/O: save -> load round trips, transformers loads our save, we load transformers' (sharded) save,
config.json parsing (transformers 4 and 5 RoPE fields, unsupported architectures), SmolLM2 from GGUF (slow)."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_codraft.models import Policy, PolicyConfig
from lightning_codraft.models import hf_io

FAMILIES = {
    "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM"),
    "tied": dict(tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
}


def _randomized(cfg: PolicyConfig) -> Policy:
    p = Policy(cfg)
    with torch.no_grad():
        for t in p.parameters():
            t.add_(0.05 * torch.randn_like(t))
    return p.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_load_round_trip_and_transformers_loads_our_save(family, tmp_path):
    cfg = PolicyConfig.tiny(**FAMILIES[family])
    ours = _randomized(cfg)
    ours.save_pretrained(tmp_path)
    again = Policy.from_pretrained(tmp_path)
    assert again.config == cfg
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if cfg.tie_word_embeddings:
        assert again.lm_head.weight is again.model.embed_tokens.weight
    ids = torch.randint(0, 128, (2, 9))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == cfg.architecture
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, again(ids).logits)
        assert (hf(ids).logits - ours(ids).logits).abs().max() <= 1e-4


def test_sharded_save_and_load_of_transformers_sharded_checkpoint(tmp_path):
    cfg = PolicyConfig.tiny(architecture="Qwen3ForCausalLM")
    ours = _randomized(cfg)
    ours.save_pretrained(tmp_path / "ours", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = Policy.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())

    d = cfg.to_hf_dict()
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    from_hf = Policy.from_pretrained(tmp_path / "hf")
    ref = hf.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in from_hf.state_dict().items())


def test_load_in_bfloat16(tmp_path):
    _randomized(PolicyConfig.tiny()).save_pretrained(tmp_path)
    p = Policy.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in p.parameters())
    assert p(torch.randint(0, 128, (5,))).logits.dtype == torch.bfloat16


def test_config_reads_transformers5_rope_parameters_and_legacy_fields():
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    c = PolicyConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in c.rope_scaling
    assert c.num_key_value_heads == 2 and c.head_dim == 4
    legacy = PolicyConfig.from_hf_dict(c.to_hf_dict())
    assert legacy == c
    qwen2 = PolicyConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                                       "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2})
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.attention_bias and not qwen2.o_proj_bias


def test_config_errors():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"unsupported architectures \['GPT2LMHeadModel'\]"):
        PolicyConfig.from_hf_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported model_type 'mixtral'"):
        PolicyConfig.from_hf_dict({**base, "model_type": "mixtral"})
    with pytest.raises(ValueError, match="does not match architecture"):
        PolicyConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLM"], "model_type": "qwen3"})
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        PolicyConfig.from_hf_dict({**base, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        PolicyConfig.from_hf_dict({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2}})
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        PolicyConfig.tiny(num_key_value_heads=3)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Policy.from_pretrained(tmp_path)
    ours = Policy(PolicyConfig.tiny())
    ours.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing \['model.layers.4"):
        Policy.from_pretrained(tmp_path)
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 4, 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"has shape \(128, 64\), config implies \(96, 64\)|has shape \(64, 128\)"):
        Policy.from_pretrained(tmp_path)


def test_smollm2_path_uses_cache_env_and_does_not_reconvert(tmp_path, monkeypatch):
    monkeypatch.setenv(hf_io.CACHE_ENV, str(tmp_path))
    target = tmp_path / "smollm2-135m-instruct"
    Policy(PolicyConfig.tiny()).save_pretrained(target)

    def fail(*a, **k):
        raise AssertionError("converted again although the cache is complete")

    monkeypatch.setattr(hf_io, "convert_gguf", fail)
    assert hf_io.smollm2_135m_path() == target


@pytest.mark.slow
def test_smollm2_135m_logits_equal_transformers_and_it_answers():
    path = hf_io.smollm2_135m_path()
    ours = Policy.from_pretrained(path).eval()
    assert (ours.config.num_hidden_layers, ours.config.hidden_size, ours.config.vocab_size) == (30, 576, 49152)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    tok = hf_io.load_smollm2_tokenizer()
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")])
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, taps=ours.default_taps)
    assert (out.logits - ref.logits).abs().max() <= 1e-4
    for t, h in zip(ours.default_taps, out.taps):          # hidden states reach |x| ~ 100: relative fp32 tolerance
        torch.testing.assert_close(h, ref.hidden_states[t], rtol=1e-5, atol=1e-4)
    assert tok.decode(out.logits[0, -1].argmax()).strip() == "France"


@pytest.mark.slow
def test_gguf_file_loads_through_the_conversion_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(hf_io.CACHE_ENV, str(tmp_path))
    gguf = hf_io.smollm2_gguf_file()
    p = Policy.from_pretrained(gguf)
    converted = hf_io.converted_gguf_dir(gguf)                 # already there: returns without converting
    assert converted.parent == tmp_path / "gguf" and (converted / "tokenizer.json").is_file()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(p(ids).logits, Policy.from_pretrained(converted)(ids).logits)
