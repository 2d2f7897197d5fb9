import math

import pytest
import torch

from lightning_codraft.training import CoDraftModule
from lightning_codraft.training.optim import adamw, cosine_decay
from codraft_fixtures import make_models


def test_cosine_decay_ends_and_midpoint():
    assert cosine_decay(0.0) == 1.0 and cosine_decay(1.0) == pytest.approx(0.0, abs=1e-15)
    assert cosine_decay(0.5, 0.1) == pytest.approx(0.55)
    assert cosine_decay(-1.0, 0.1) == 1.0 and cosine_decay(2.0, 0.1) == pytest.approx(0.1)
    # bit for bit the warm-ups' former formula
    for i in range(0, 12):
        assert cosine_decay(i / 10, 0.1) == 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, 10) / 10))


def test_module_schedule_warms_up_then_decays():
    module = CoDraftModule(*make_models(), policy_lr_warmup_steps=2, schedule="cosine", total_steps=6)
    fn = module.lr_lambda("policy")
    assert [fn(0), fn(1)] == [0.5, 1.0]
    assert fn(2) == 1.0 and fn(6) == pytest.approx(0.0, abs=1e-15) and fn(4) == pytest.approx(0.5)
    opt = adamw([torch.nn.Parameter(torch.zeros(2))], 1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1


def test_the_lr_warmup_knobs_say_lr():
    """``draft_warmup_steps`` read like the recipe's draft warm-up (``draft.warm_start.steps``); the LR ramp's knobs are
    ``*_lr_warmup_steps`` and the old names are refused with the new one."""
    with pytest.raises(TypeError, match="draft_lr_warmup_steps"):
        CoDraftModule(*make_models(), draft_warmup_steps=2)
