import pytest
import torch

from lightning_codraft.attention.packing import pack_documents
from lightning_codraft.models import Policy, PolicyConfig
from lightning_codraft.parallel.pipeline import (MicrobatchMeta, PolicyStage, Pruned, StageLayout,
                                                 check_num_microbatches, prune_unowned)


def test_balanced_split_gives_extra_layers_to_the_first_stages():
    assert StageLayout.split(7, 3).layer_ranges == ((0, 3), (3, 5), (5, 7))
    assert StageLayout.split(4, 4).layer_ranges == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert StageLayout.split(5, 1).layer_ranges == ((0, 5),)
    assert StageLayout.split(6, 2, layers_per_stage=(4, 2)).layer_ranges == ((0, 4), (4, 6))


def test_tap_owner_is_the_stage_holding_the_layer_the_tap_enters():
    layout = StageLayout.split(6, 3)  # (0,2) (2,4) (4,6)
    assert layout.tap_owners([5, 0, 2, 6, 1, 2]) == {0: 0, 1: 0, 2: 1, 5: 2, 6: 2}


@pytest.mark.parametrize("call, match", [
    (lambda: StageLayout.split(3, 4), "4 pipeline stages for a policy of 3 layers"),
    (lambda: StageLayout.split(6, 2, layers_per_stage=(3, 2)), "must be >= 1 each and sum to the 6 layers"),
    (lambda: StageLayout.split(6, 2, layers_per_stage=(6, 0)), "must be >= 1 each"),
    (lambda: StageLayout.split(6, 3, layers_per_stage=(3, 3)), "has 2 entries for 3 stages"),
    (lambda: StageLayout.split(6, 2).tap_owner(7), "tap layer 7 is outside the model: tap ids are 0..6"),
    (lambda: StageLayout.split(6, 2).tap_owner(-1), "tap layer -1 is outside the model"),
    (lambda: check_num_microbatches("1f1b", 2, 4), "1F1B schedule needs at least as many microbatches as stages"),
    (lambda: check_num_microbatches("gpipe", 0, 2), "num_microbatches=0 must be >= 1"),
    (lambda: check_num_microbatches("zb", 4, 2), "schedule='zb' is not one of"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_stages_chained_in_one_process_equal_the_policy_and_emit_its_taps():
    policy = Policy(PolicyConfig.tiny(num_hidden_layers=5))
    batch = pack_documents([list(range(3, 12)), list(range(20, 27))])
    ref = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, taps=(0, 2, 3, 5))
    layout = StageLayout.split(5, 3)  # (0,2) (2,4) (4,5)
    seen = {}
    stages = [PolicyStage(policy, layout, s, tap_sink=lambda m, t, h: seen.__setitem__((m, t), h),
                          tap_ids=(0, 2, 3, 5)) for s in range(3)]
    assert [len(s.layers) for s in stages] == [2, 2, 1]
    owned = {n for s in stages for n, _ in s.named_parameters()}
    assert "embed_tokens.weight" in owned and "lm_head.weight" in owned
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in policy.parameters())
    meta = MicrobatchMeta(batch.cu_seqlens, batch.position_ids)
    x = batch.input_ids.unsqueeze(0)
    for s in stages:
        s.set_microbatches([meta, meta])
        x = s(x, torch.tensor([1]))
    torch.testing.assert_close(x, ref.logits, rtol=0, atol=0)
    assert sorted(seen) == [(1, 0), (1, 2), (1, 3), (1, 5)]
    for tap, expected in zip((0, 2, 3, 5), ref.taps):
        torch.testing.assert_close(seen[(1, tap)], expected, rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_still_runs_after_the_rest_of_the_policy_is_released(tied):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(num_hidden_layers=4, tie_word_embeddings=tied))
    batch = pack_documents([list(range(3, 12)), list(range(20, 27))])
    meta = MicrobatchMeta(batch.cu_seqlens, batch.position_ids)
    full = Policy(PolicyConfig.tiny(num_hidden_layers=4, tie_word_embeddings=tied))
    full.load_state_dict(policy.state_dict())
    hidden = full.embed(batch.input_ids)
    cos, sin = full.rotary(batch.position_ids)
    for layer in full.model.layers[:3]:
        hidden = layer(hidden, cos, sin, batch.cu_seqlens)
    stage = PolicyStage(policy, StageLayout.split(4, 2, layers_per_stage=(3, 1)), 1)
    kept = {id(p) for p in stage.parameters()}
    total = sum(p.numel() * p.element_size() for p in policy.parameters())
    freed = prune_unowned(policy, stage.owned_modules())
    held = sum(p.numel() * p.element_size() for p in policy.parameters())
    assert freed + held == total and held == sum(p.numel() * p.element_size() for p in stage.parameters())
    assert {id(p) for p in policy.parameters()} == kept
    names = set(policy.state_dict())  # the kept entries keep their full names (layer indices never shift)
    assert {"model.layers.3.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert names <= set(full.state_dict()) and not any(n.startswith("model.layers.0.") for n in names)
    assert isinstance(policy.model.layers[0], Pruned) and not isinstance(policy.model.layers[3], Pruned)
    assert isinstance(policy.model.embed_tokens, Pruned)  # tied or not: the last stage holds lm_head only
    with pytest.raises(RuntimeError, match="model.layers.0 lives on another pipeline stage"):
        policy.model.layers[0](hidden, cos, sin, batch.cu_seqlens)
    assert prune_unowned(policy, stage.owned_modules()) == 0  # idempotent
    stage.set_microbatches([meta])
    torch.testing.assert_close(stage(hidden, torch.tensor([0])), full.head(full.model.layers[3](
        hidden, cos, sin, batch.cu_seqlens)), rtol=0, atol=0)
