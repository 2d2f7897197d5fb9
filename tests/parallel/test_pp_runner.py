"""The pipeline runner with a joint RL + draft loss function equals the single-process step: losses, every gradient,
and the shipped taps."""

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_codraft.attention.packing import pack_documents, shift_left_local
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.batch import RLBatch
from lightning_codraft.parallel.pp_runner import PipelineRunner
from lightning_codraft.training.draft_loss import ttt_draft_loss
from lightning_codraft.training.rl_loss import policy_gradient_loss

V, K = 96, 2


def _microbatch(gen, lengths, multiple_of):
    """One next-token-aligned RL batch (interfaces.md) with random completions, advantages and old log-probs."""
    b = pack_documents([torch.randint(1, V, (n,), generator=gen) for n in lengths], multiple_of=multiple_of)
    T = b.num_tokens
    target = shift_left_local(b.input_ids, b.cu_seqlens, 1, fill=0)
    next_valid = shift_left_local(b.valid, b.cu_seqlens, 1, fill=False)
    loss_mask = (next_valid & (b.position_ids >= 2)).float()
    return RLBatch(input_ids=b.input_ids, target_ids=target, position_ids=b.position_ids, cu_seqlens=b.cu_seqlens,
                   valid=b.valid, loss_mask=loss_mask, old_logprobs=-3 * torch.rand(T, generator=gen) * loss_mask,
                   advantages=torch.randn(T, generator=gen) * loss_mask, draft_mask=b.valid.float())


def pad_microbatches(mbs, multiple_of):
    length = -(-max(mb.num_tokens for mb in mbs) // multiple_of) * multiple_of
    return [mb.pad_to(length) for mb in mbs]


def _loss_fn(draft, taps, cp_group, draft_weight=1.0, num_mb=1):
    """One microbatch's share of a step whose objective is the mean of the microbatches' token means, written from
    the definitions (the runner sums the shares its loss function returns)."""

    def fn(logits, shipped, mb):
        logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.target_ids.unsqueeze(-1)).squeeze(-1)
        rl, stats = policy_gradient_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask, group=cp_group)
        if draft is None:
            return rl / num_mb, (rl.detach(), torch.zeros(()), {k: float(v) for k, v in stats.items()})
        embeds = [mb.shift_left(shipped[0], k + 1, group=cp_group) for k in range(K)]
        steps = draft.ttt_forward([shipped[t] for t in taps], embeds, mb.cu_seqlens, mb.position_ids,
                                  cp_group=cp_group)
        dl = ttt_draft_loss([lg for lg, _ in steps], logits.detach(), mb.cu_seqlens, mb.draft_targets, draft.d2t,
                            draft.t2d, group=cp_group)
        rl_global = float(stats["loss"])
        record = (rl_global, float(dl.loss), {k: float(v) for k, v in stats.items()})
        return (rl + draft_weight * dl.loss) / num_mb, record

    return fn


def _models(num_layers, taps, tie):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=V, num_hidden_layers=num_layers, tie_word_embeddings=tie))
    counts = torch.rand(V, generator=torch.Generator().manual_seed(1))
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=V // 2, taps=taps, token_counts=counts)
    return policy, draft


def _reference_step(policy, draft, microbatches, draft_weight=1.0):
    """Single process, whole batches: (1/M) sum_m (rl_m + w draft_m) with embeddings of the shifted ids."""
    rl_total = dl_total = 0.0
    taps, rl_stats = {}, {"clip_frac": 0.0, "num_tokens": 0.0}
    for m, mb in enumerate(microbatches):
        ids, cu = mb.input_ids, mb.cu_seqlens
        out = policy(ids, cu_seqlens=cu, position_ids=mb.position_ids, taps=(0, *draft.config.taps))
        logp = torch.log_softmax(out.logits, -1).gather(-1, mb.target_ids.unsqueeze(-1)).squeeze(-1)
        rl, stats = policy_gradient_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask)
        rl_stats["clip_frac"] += float(stats["clip_frac"]) / len(microbatches)  # means: averaged over microbatches
        rl_stats["num_tokens"] += float(stats["num_tokens"])  # counts: summed
        embeds = [policy.embed(shift_left_local(ids, cu, k + 1, fill=0)).detach() for k in range(K)]
        steps = draft.ttt_forward([t.detach() for t in out.taps[1:]], embeds, cu, mb.position_ids)
        dl = ttt_draft_loss([lg for lg, _ in steps], out.logits.detach(), cu, mb.draft_mask, draft.d2t, draft.t2d)
        ((rl + draft_weight * dl.loss) / len(microbatches)).backward()
        rl_total += float(rl.detach()) / len(microbatches)
        dl_total += float(dl.loss.detach()) / len(microbatches)
        taps[m] = {t: x.detach() for t, x in zip((0, *draft.config.taps), out.taps)}
    return rl_total, dl_total, taps, rl_stats


def _zigzag(x, cu, rank, cp):
    """Rank ``rank``'s zigzag shard by the definition: chunks r and 2cp-1-r of every document."""
    parts = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        chunks = x[s:e].chunk(2 * cp)
        parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(parts)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _worker(rank, world_size, pp, cp, num_layers, taps, split, schedules, tie, num_mb):
    p, c = divmod(rank, cp)
    pp_groups, tap_groups, cp_groups = {}, {}, {}
    for cc in range(cp):
        ranks = [q * cp + cc for q in range(pp)]
        pp_groups[cc], tap_groups[cc] = dist.new_group(ranks), dist.new_group(ranks)
    for q in range(pp):
        cp_groups[q] = dist.new_group([q * cp + cc for cc in range(cp)]) if cp > 1 else None
    gen = torch.Generator().manual_seed(7)
    whole = pad_microbatches([_microbatch(gen, [5 + 3 * m, 9, 4 + m], 2 * cp) for m in range(num_mb)], 2 * cp)
    mine = [mb.shard(c, cp) for mb in whole]
    for mb, ref in zip(mine, whole):  # RLBatch.shard is the zigzag definition
        assert torch.equal(mb.input_ids, _zigzag(ref.input_ids, ref.cu_seqlens, c, cp))

    policy, draft = _models(num_layers, taps, tie)
    ref_policy, ref_draft = copy.deepcopy(policy), copy.deepcopy(draft)
    ref_rl, ref_dl, ref_taps, ref_stats = _reference_step(ref_policy, ref_draft, whole)
    ref_grads = {id(p): q.grad for p, q in zip(policy.parameters(), ref_policy.parameters())}
    ref_grads.update({id(p): q.grad for p, q in zip(draft.parameters(), ref_draft.parameters())})
    report = {}
    for schedule in schedules:
        policy.zero_grad(set_to_none=True)
        draft.zero_grad(set_to_none=True)
        runner = PipelineRunner(policy, stage=p, num_stages=pp, pp_group=pp_groups[c], tap_group=tap_groups[c],
                                cp_group=cp_groups[p], tap_ids=(0, *draft.config.taps), schedule=schedule,
                                layers_per_stage=split)
        loss_fn = _loss_fn(draft if p == pp - 1 else None, draft.config.taps, cp_groups[p], num_mb=num_mb)
        if schedule == "1f1b" and pp > 1:
            with pytest.raises(ValueError, match=f"got 1 microbatches for {pp} stages"):
                runner.step(mine[:1], loss_fn)
        received = {}
        if runner.is_last:
            receive = runner.channel.receive
            runner.channel.receive = lambda m: received.setdefault(m, {t: x.clone() for t, x in receive(m).items()})
        records = runner.step(mine, loss_fn)
        assert len(records) == num_mb  # the loss function's records reach every stage
        rl = sum(r[0] for r in records) / num_mb
        dl = sum(r[1] for r in records) / num_mb
        assert abs(rl - ref_rl) <= 1e-5 * abs(ref_rl), (schedule, rl, ref_rl)
        assert abs(dl - ref_dl) <= 1e-5 * abs(ref_dl), (schedule, dl, ref_dl)
        clip = sum(r[2]["clip_frac"] for r in records) / num_mb
        assert abs(clip - ref_stats["clip_frac"]) <= 1e-6, (schedule, clip)
        assert sum(r[2]["num_tokens"] for r in records) == ref_stats["num_tokens"]
        errors = {}
        for name, param in list(runner.stage_module.named_parameters()) + list(
                draft.named_parameters(prefix="draft") if runner.is_last else []):
            grad = param.grad.clone()
            if cp > 1:  # each CP rank holds its share of the gradient
                dist.all_reduce(grad, group=cp_groups[p])
            errors[name] = _rel(grad, ref_grads[id(param)])
        assert max(errors.values()) <= 1e-5, (schedule, {k: v for k, v in errors.items() if v > 1e-5})
        if runner.is_last:
            assert sorted(received) == list(range(num_mb))
            for m in range(num_mb):
                assert sorted(received[m]) == sorted({0, *taps})
                for t, x in received[m].items():
                    expected = ref_taps[m][t] if cp == 1 else _zigzag(ref_taps[m][t], whole[m].cu_seqlens, c, cp)
                    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
        report[schedule] = (len(errors), runner.tap_bytes_last_step, rl + dl)
    return report


def test_pp2_gpipe_and_1f1b_equal_single_process():
    # 4 layers as (2, 2): tap 0 and 1 are shipped from stage 0, taps 2 and 3 stay on the last stage
    results = run_distributed(_worker, 2, args=(2, 1, 4, (1, 2, 3), None, ("gpipe", "1f1b"), False, 3), timeout=240)
    n_params, tap_bytes, loss = results[0]["gpipe"]
    assert tap_bytes > 0 and results[1]["gpipe"][1] == 0
    assert results[0]["1f1b"][2] == pytest.approx(loss, rel=1e-6)


def test_pp4_uneven_split_tied_embeddings_equal_single_process():
    # 6 layers as (1, 2, 2, 1); taps 1 (stage 1), 3 (stage 2), 5 (last) and 0 (stage 0); lm_head tied to embed
    results = run_distributed(_worker, 4, args=(4, 1, 6, (1, 3, 5), (1, 2, 2, 1), ("1f1b", "gpipe"), True, 4),
                              timeout=300)
    assert [r["1f1b"][1] > 0 for r in results] == [True, True, True, False]


def test_pp2_x_cp2_equal_single_process():
    results = run_distributed(_worker, 4, args=(2, 2, 4, (1, 2, 3), None, ("1f1b",), False, 2), timeout=300)
    assert [r["1f1b"][1] > 0 for r in results] == [True, True, False, False]  # stage 0 of each cp rank ships


@pytest.mark.slow
def test_pp2_x_cp2_gpipe_tied_equal_single_process():
    results = run_distributed(_worker, 4, args=(2, 2, 4, (1, 2, 3), None, ("gpipe",), True, 3), timeout=300)
    assert [r["gpipe"][1] > 0 for r in results] == [True, True, False, False]


def test_taps_outside_the_model_and_too_many_stages_are_refused():
    policy, _ = _models(4, (1, 2, 3), False)
    with pytest.raises(ValueError, match="tap layer 7 is outside the model: tap ids are 0..4"):
        PipelineRunner(policy, stage=0, num_stages=1, pp_group=None, tap_group=None, tap_ids=(0, 1, 7))
    with pytest.raises(ValueError, match="5 pipeline stages for a policy of 4 layers"):
        PipelineRunner(policy, stage=0, num_stages=5, pp_group=None, tap_group=None)


def test_microbatches_of_different_lengths_are_refused():
    policy, draft = _models(4, (1, 2, 3), False)
    runner = PipelineRunner(policy, stage=0, num_stages=1, pp_group=None, tap_group=None,
                            tap_ids=(0, *draft.config.taps))
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="different token counts \\[7, 9\\].*pad_to"):
        runner.step([_microbatch(gen, [7], 1), _microbatch(gen, [9], 1)],
                    _loss_fn(draft, draft.config.taps, None, num_mb=2))


def test_padding_microbatches_to_one_length_changes_no_loss():
    gen = torch.Generator().manual_seed(3)
    mbs = [_microbatch(gen, [6, 3], 1), _microbatch(gen, [11], 1)]
    padded = pad_microbatches(mbs, multiple_of=4)
    assert [mb.num_rows for mb in padded] == [12, 12]
    assert padded[0].cu_seqlens.tolist() == [0, 6, 9, 12] and padded[1].cu_seqlens.tolist() == [0, 11, 12]
    policy, draft = _models(4, (1, 2, 3), False)
    assert _reference_step(policy, draft, padded)[:2] == pytest.approx(_reference_step(policy, draft, mbs)[:2],
                                                                        rel=1e-6)
