"""Bounded staleness (rl/bounded_rollouts.py) on a fake step whose producer and trainer run at speeds the test sets:
the staleness bound holds whichever side is slow (the slow side makes the other wait), a dropped group returns its
capacity (the run would stop otherwise), eta = 0 is on-policy, and a run stopped mid-batch and resumed from its state
consumes every group of the prompt stream exactly once, as an uninterrupted run does."""

import threading
import time
from types import SimpleNamespace

import pytest

from lightning_codraft.rl.bounded_rollouts import BoundedRollouts
from lightning_codraft.rl.step import Generation
from lightning_codraft.rl.tasks.rewards import RewardScores
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput

P, G = 3, 2


class FakeStep:
    """What BoundedRollouts reads of an RLStep: the config, the task, the worker's snapshot / prepare, generation,
    the tokenizer and the rewards. A sample's token is its prompt's stream index; its reward is 1 unless the
    stream index is in ``uniform`` (then every sample of the group scores 0)."""

    def __init__(self, steps, gen_s=0.0, uniform=()):
        self.cfg = SimpleNamespace(
            rl=SimpleNamespace(prompts_per_step=P, group_size=G, steps=steps),
            draft=SimpleNamespace(mode="none", loss_weight=0.0),
            run=SimpleNamespace(seed=0),
        )
        self.schedule = SimpleNamespace(updates=0)
        self.version = 0  # the "training state": the trainer bumps it after each step
        self.gen_s, self.uniform = gen_s, set(uniform)
        self.task = SimpleNamespace(sample=lambda n, seed: [SimpleNamespace(prompt=f"p{seed}-{j}") for j in range(n)])
        self.worker = SimpleNamespace(snapshot=lambda: {"version": self.version}, prepare=self._prepare)
        self.tokenizer = SimpleNamespace(decode=lambda ids: str(ids[0]))
        self.rewards = SimpleNamespace(score=self._score)
        self.refits: list[int] = []

    def _prepare(self, versions, state):
        assert state["version"] == versions["policy"]  # refitted from the snapshot of that version
        self.refits.append(versions["policy"])
        return 0.0

    def generate_prepared(self, step, mine, versions, refit_s, places):
        time.sleep(self.gen_s)
        outs = [
            RolloutOutput([s * P + j], [0.0], "stop", AcceptanceStats(), versions["policy"], versions["draft"])
            for s, j in places
            for _ in range(G)
        ]
        return Generation([[1]] * len(outs), outs, AcceptanceStats(), self.gen_s, refit_s, versions)

    def _score(self, prompts, texts, samples):
        return RewardScores([0.0 if int(t) in self.uniform else 1.0 + i for i, t in enumerate(texts)])


def run(rl, producer, steps, start=0, train_s=0.0):
    """The trainer: take each step, 'train' (bump the version after ``train_s``); returns the Produced list."""
    got = []
    for t in range(start, steps):
        got.append(producer.take(t))
        time.sleep(train_s)
        rl.version = t + 1
    return got


def staleness(produced):
    return [produced.step - o.policy_version for o in produced.gen.outs]


def within(fn, seconds=60):
    """``fn()`` on a thread that must end within ``seconds`` (a hang fails the test instead of stopping it)."""
    box = {}

    def body():
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            box["error"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), "the trainer waited forever"
    if "error" in box:
        raise box["error"]
    return box["out"]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_a_slow_trainer_holds_the_producer_at_its_capacity(eta):
    """The producer is fast, the trainer slow: the producer waits; it never admits more than eta + 1 steps of work
    ahead of the trainer, and no step trains on a group staler than eta."""
    rl = FakeStep(steps=6)
    producer = BoundedRollouts(rl, eta, 6)
    got = within(lambda: run(rl, producer, 6, train_s=0.05))
    producer.close()
    for first, n, version, dropped in producer.admissions:
        assert first + n <= min(version + eta + 1, 6) * P + dropped
    assert max(max(staleness(p)) for p in got) == eta  # the producer ran as far ahead as it may, no further
    assert [p.prompts[0].prompt for p in got] == [f"p{1 + t}-0" for t in range(6)]  # the stream, in order


@pytest.mark.parametrize("eta", [1, 2])
def test_a_slow_producer_makes_the_trainer_wait_never_the_bound_break(eta):
    rl = FakeStep(steps=4, gen_s=0.05)
    producer = BoundedRollouts(rl, eta, 4)
    got = within(lambda: run(rl, producer, 4))
    producer.close()
    assert all(0 <= s <= eta for p in got for s in staleness(p))
    assert sum(p.wait_s for p in got) > 0.1  # the trainer waited for the producer
    assert sorted(rl.refits) == rl.refits  # each batch refitted to the newest published version


def test_eta_zero_is_on_policy():
    rl = FakeStep(steps=3, gen_s=0.01)
    producer = BoundedRollouts(rl, 0, 3)
    got = within(lambda: run(rl, producer, 3, train_s=0.02))
    producer.close()
    assert [set(staleness(p)) for p in got] == [{0}] * 3


def test_a_dropped_group_returns_its_capacity():
    """Uniform groups are dropped and replaced by the next ones of the stream: every step still gets P groups. The
    producer at its capacity with nothing queued would leave the trainer waiting forever without the return (raised,
    not hung)."""
    uniform = {0, 1, 4, 6, 7, 8}
    rl = FakeStep(steps=3, uniform=uniform)
    producer = BoundedRollouts(rl, 0, 3, drop_uniform=True)
    got = within(lambda: run(rl, producer, 3, train_s=0.01))
    producer.close()
    kept = [i for r in producer.ledger for i in r["kept"]]
    dropped = [i for r in producer.ledger for i in r["dropped"]]
    assert sorted(dropped) == sorted(uniform) and sorted(kept + dropped) == list(range(9 + len(uniform)))
    assert [p.dropped for p in got] == [3, 3, 0]  # step 0 keeps 2, 3, 5; step 1 keeps 9, 10, 11
    assert [r["kept"] for r in producer.ledger] == [[2, 3, 5], [9, 10, 11], [12, 13, 14]]
    assert all(len(p.prompts) == P and 0.0 not in p.scores.total for p in got)
    assert all(s == 0 for p in got for s in staleness(p))


def test_the_uniform_filter_off_keeps_every_group():
    rl = FakeStep(steps=2, uniform={0, 1, 2, 3})
    producer = BoundedRollouts(rl, 1, 2)
    got = within(lambda: run(rl, producer, 2))
    producer.close()
    assert [p.dropped for p in got] == [0, 0] and producer.ledger[0]["kept"] == [0, 1, 2]


def test_a_stop_mid_batch_then_resume_consumes_every_group_once():
    """State taken while a batch is in flight (it is generated again on resume, first): the resumed run's steps
    keep and drop the same stream indices as an uninterrupted run, each exactly once."""
    uniform = {2, 5}
    full = FakeStep(steps=5, uniform=uniform)
    whole = BoundedRollouts(full, 1, 5, drop_uniform=True)
    within(lambda: run(full, whole, 5))
    whole.close()

    rl = FakeStep(steps=5, gen_s=0.05, uniform=uniform)
    first = BoundedRollouts(rl, 1, 5, drop_uniform=True)
    within(lambda: run(rl, first, 2))
    time.sleep(0.02)  # the producer is generating the next batch
    assert first._in_flight is not None
    state = first.state_dict()
    first.close()  # the process dies: what it generated after the state is lost
    resumed = BoundedRollouts(rl, 1, 5, drop_uniform=True)
    resumed.load_state_dict(state)
    within(lambda: run(rl, resumed, 5, start=2))
    resumed.close()
    assert resumed.ledger == whole.ledger  # the same groups kept and dropped by every step
    consumed = [i for r in resumed.ledger for i in r["kept"] + r["dropped"]]
    assert sorted(consumed) == list(range(len(consumed)))


def test_a_failing_producer_is_raised_on_the_trainer_side():
    rl = FakeStep(steps=2)
    rl.generate_prepared = lambda *a, **k: (_ for _ in ()).throw(OSError("engine died"))
    producer = BoundedRollouts(rl, 1, 2)
    with pytest.raises(RuntimeError, match="producer failed") as info:
        within(lambda: producer.take(0))
    assert isinstance(info.value.__cause__, OSError)
