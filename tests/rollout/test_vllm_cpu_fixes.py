"""The vLLM-CPU sampling probes and fixes, without vLLM: a simulated unfixed build is detected and patched, a
correct build is left alone (the fixes inside a real vLLM worker: test_vllm_sampling.py)."""

from types import SimpleNamespace

import pytest
import torch

from lightning_codraft.rollout.vllm.cpu_fixes import (
    apply_fixes, expand_batch_to_tokens, guard_empty_rows, probe_expand, probe_top_k_only)


def reference_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """From the definition, one token at a time: request b's value for each of its tokens."""
    out, start = [], 0
    for b, end in enumerate(cu_num_tokens.tolist()):
        v = x[b].item()
        out += [replace_to if v == replace_from else v] * (end - start)
        start = end
    return torch.tensor(out, dtype=x.dtype)


def unfixed_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """vllm-cpu 0.32's behaviour: the CPU kernel writes into ``output.to(torch.int64)``, a copy."""
    output = x.new_empty(num_tokens)
    scratch = output.to(torch.int64)  # what _expand_kernel_impl hands the C++ op; never copied back
    scratch[:] = reference_expand(x, cu_num_tokens, num_tokens, replace_from, replace_to).to(torch.int64)
    return output


def unfixed_top_k_only(logits, k):
    """vLLM's apply_top_k_only, whose ``k.max()`` raises on zero rows."""
    max_top_k = k.max()
    kth = logits.topk(int(max_top_k), dim=1).values.gather(1, (k.long() - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, -float("inf"))


def test_pure_torch_expand_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.int32, torch.int64):
        counts = torch.randint(0, 5, (7,), generator=g)
        cu = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randint(-2, 3, (7,), generator=g).to(dtype)
        n = int(cu[-1])
        got = expand_batch_to_tokens(x, cu, n, replace_from=0, replace_to=9)
        assert got.dtype == dtype and torch.equal(got, reference_expand(x, cu, n, 0, 9))


def test_probe_detects_the_unfixed_expand_and_the_fix_repairs_it():
    for _ in range(20):  # the unfixed function returns uninitialised memory: never mistaken for a right answer
        assert "expected [0.25, 0.25, 1, 1, 1, 1.75]" in probe_expand(unfixed_expand)
    vllm = SimpleNamespace(expand_batch_to_tokens=unfixed_expand)
    topk = SimpleNamespace(apply_top_k_only=unfixed_top_k_only)
    report = apply_fixes(vllm, topk)
    assert report["expand_batch_to_tokens"].startswith("fixed: ")
    assert vllm.expand_batch_to_tokens is expand_batch_to_tokens
    assert probe_expand(vllm.expand_batch_to_tokens) is None


def test_probe_leaves_a_correct_build_alone():
    vllm = SimpleNamespace(expand_batch_to_tokens=reference_expand)
    topk = SimpleNamespace(apply_top_k_only=guard_empty_rows(unfixed_top_k_only))
    guarded = topk.apply_top_k_only
    assert probe_expand(reference_expand) is None and probe_top_k_only(guarded) is None
    assert apply_fixes(vllm, topk) == {"expand_batch_to_tokens": "ok", "apply_top_k_only": "ok"}
    assert vllm.expand_batch_to_tokens is reference_expand and topk.apply_top_k_only is guarded


def test_top_k_probe_and_guard():
    assert "raised RuntimeError" in probe_top_k_only(unfixed_top_k_only)
    topk = SimpleNamespace(apply_top_k_only=unfixed_top_k_only)
    report = apply_fixes(SimpleNamespace(expand_batch_to_tokens=reference_expand), topk)
    assert report["apply_top_k_only"].startswith("fixed: ")
    empty = torch.zeros(0, 8)
    assert topk.apply_top_k_only(empty, torch.zeros(0, dtype=torch.int32)) is empty
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.9], [1.0, 0.2, 0.7, 0.4]])
    k = torch.tensor([2, 1], dtype=torch.int32)
    out = topk.apply_top_k_only(logits.clone(), k)  # non-empty rows: vLLM's function, unchanged
    assert torch.equal(out, unfixed_top_k_only(logits.clone(), k))
    assert torch.isinf(out).sum().item() == 2 + 3


def test_disabled_fixes_report_the_defect_and_patch_nothing():
    vllm = SimpleNamespace(expand_batch_to_tokens=unfixed_expand)
    topk = SimpleNamespace(apply_top_k_only=unfixed_top_k_only)
    report = apply_fixes(vllm, topk, enabled=False)
    assert all(v.startswith("defect, not fixed: ") for v in report.values())
    assert vllm.expand_batch_to_tokens is unfixed_expand and topk.apply_top_k_only is unfixed_top_k_only


def test_a_fix_that_does_not_take_raises():
    class Frozen(SimpleNamespace):  # a module whose attribute cannot be replaced
        def __setattr__(self, name, value):
            if name in self.__dict__:
                return
            super().__setattr__(name, value)

    with pytest.raises(RuntimeError, match="did not take"):
        apply_fixes(Frozen(expand_batch_to_tokens=unfixed_expand), SimpleNamespace(apply_top_k_only=guard_empty_rows(
            unfixed_top_k_only)))
