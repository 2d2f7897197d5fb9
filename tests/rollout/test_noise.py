"""Counter-based noise (rollout/sampling/noise.py): the hash is SplitMix64 (published test vector, a Python-int reference),
its uniforms are uniform down to their low bits and near 0 (with a negative control: the 24-bit construction fails
the low-bit test), neighbours in id, position, seed and purpose are independent, the Gumbel noise has the Gumbel
moments and samples a distribution's rare tokens at their rate, and every value is a pure function of (seed,
position, purpose, id): the same whatever else is drawn, however the rows are chunked or selected."""

import math

import pytest
import torch

from lightning_codraft.rollout.sampling import noise
from lightning_codraft.rollout.sampling.noise import ACCEPT, DRAFT, TOKEN, CounterNoise, mix64, mix64_int, request_seed
from lightning_codraft.rollout.sampling.noise import resolve_request_seeds, seed_tensor
from lightning_codraft.rollout.sampling.rules import gumbel_argmax

MASK = (1 << 64) - 1
Z = 5.0   # two-sided z bound of the frequency tests (p ~ 6e-7 each)


def _chi2_crit(df, z=4.265):
    """Upper 1e-5 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2_uniform(values, bins):
    """Chi-square statistic of values in [0, 1) against the uniform distribution over ``bins`` equal bins."""
    counts = torch.bincount((values.double() * bins).long().clamp(0, bins - 1), minlength=bins).double()
    expected = len(values) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def _draw(n_seeds=64, n_pos=16, n_ids=4096, purpose=TOKEN, first_seed=0):
    """(n_seeds, n_pos, n_ids) uniforms of consecutive seeds, positions and ids (the most structured inputs)."""
    src = CounterNoise(seed_tensor(range(first_seed, first_seed + n_seeds)))
    return src.uniform(torch.arange(n_pos).expand(n_seeds, n_pos), purpose, torch.arange(n_ids))


def test_mix64_is_splitmix64():
    # Vigna's splitmix64.c from seed 1234567: x += 0x9E3779B97F4A7C15, then the finaliser
    x, out = 1234567, []
    for _ in range(5):
        x = (x + 0x9E3779B97F4A7C15) & MASK
        out.append(mix64_int(x))
    assert out == [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                   16408922859458223821]
    xs = torch.randint(-2 ** 63, 2 ** 63 - 1, (2000,), generator=torch.Generator().manual_seed(0))
    expected = [(v := mix64_int(int(x) & MASK)) - (1 << 64) * (v >> 63) for x in xs.tolist()]
    assert mix64(xs).tolist() == expected


def test_uniforms_are_uniform_and_inside_the_open_interval():
    u = _draw().reshape(-1)                                     # 4M values
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert _chi2_uniform(u, 256) < _chi2_crit(255)
    assert abs(float(u.double().mean()) - 0.5) < Z * math.sqrt(1 / 12 / len(u))


def _low_bit_failures(u):
    """Octaves of [2**-12, 1) in which the last mantissa bit of the float32 values is not balanced."""
    bits = u.float().view(torch.int32)
    failures = []
    for octave in range(12):
        inside = (u >= 2.0 ** -(octave + 1)) & (u < 2.0 ** -octave)
        n = int(inside.sum())
        ones = int((bits[inside] & 1).sum())
        if n and abs(ones - n / 2) > Z * math.sqrt(n / 4):
            failures.append((octave, ones, n))
    return failures


def test_low_mantissa_bits_are_uniform():
    """Every float32 octave of the uniforms has balanced last mantissa bits, and the values below 2**-12 are
    uniform at float32 resolution; the usual 24-bit construction (m * 2**-24) fails the same test."""
    u = _draw().reshape(-1)
    assert _low_bit_failures(u) == []
    small = u[u < 2.0 ** -12] * 2.0 ** 12
    assert len(small) > 500 and _chi2_uniform(small, 16) < _chi2_crit(15)
    coarse = (torch.randint(0, 2 ** 24, (len(u),), generator=torch.Generator().manual_seed(1)).float()
              * 2.0 ** -24)
    assert _low_bit_failures(coarse) != []   # negative control: the test can fail


@pytest.mark.parametrize("axis", ["id", "position", "seed", "purpose"])
def test_neighbours_are_independent(axis):
    """Pairs of values one step apart along each input (and across purposes) are uncorrelated and jointly
    uniform over an 8 x 8 grid."""
    u = _draw()
    if axis == "id":
        a, b = u[:, :, :-1], u[:, :, 1:]
    elif axis == "position":
        a, b = u[:, :-1], u[:, 1:]
    elif axis == "seed":
        a, b = u[:-1], u[1:]
    else:
        a, b = u, _draw(purpose=DRAFT)
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    corr = float(((a - 0.5) * (b - 0.5)).mean() * 12)
    assert abs(corr) < Z / math.sqrt(len(a))
    cells = (a * 8).long().clamp_max(7) * 8 + (b * 8).long().clamp_max(7)
    assert _chi2_uniform(cells.double() / 64 + 1e-9, 64) < _chi2_crit(63)


def test_hash_bits_are_balanced():
    """Each of the 64 output bits of the hash on consecutive counters is set half of the time."""
    z = mix64(torch.arange(1 << 16))
    n = len(z)
    for bit in range(64):
        ones = int(((z >> bit) & 1).sum())
        assert abs(ones - n / 2) < Z * math.sqrt(n / 4), bit


def test_gumbel_moments_and_rare_tokens():
    src = CounterNoise(seed_tensor(range(256)))
    g = src.gumbel(torch.arange(64).expand(256, 64), TOKEN, torch.arange(64)).reshape(-1).double()   # 1M values
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772156649) < Z * math.sqrt(math.pi ** 2 / 6 / len(g))
    assert abs(float(g.var()) - math.pi ** 2 / 6) < 0.03
    probs = torch.tensor([0.5, 0.3, 0.199, 0.001], dtype=torch.float64)
    draws = gumbel_argmax(probs.log().float(), src.gumbel(torch.arange(4096).expand(256, 4096), TOKEN,
                                                          torch.arange(4)))                # 1M samples
    counts = torch.bincount(draws.reshape(-1), minlength=4).double()
    expected = probs * draws.numel()
    assert float(((counts - expected) ** 2 / expected).sum()) < _chi2_crit(3)
    assert abs(counts[3] - expected[3]) < Z * math.sqrt(expected[3])   # the 1e-3 token at its rate


def test_values_are_a_pure_function_of_their_inputs(monkeypatch):
    """Rows selected, reordered, drawn in smaller chunks, with other ids beside them, at other positions beside
    them, or hashed with other purposes first: every value is unchanged, bit for bit."""
    seeds = seed_tensor([request_seed(7, i) for i in range(5)])
    pos = torch.tensor([[0, 1, 2], [5, 6, 7], [3, 4, 5], [0, 1, 2], [9, 10, 11]])
    ids = torch.arange(300)
    full = CounterNoise(seeds).gumbel(pos, TOKEN, ids)
    order = torch.tensor([3, 0, 4])
    src = CounterNoise(seeds)
    src.uniform(pos, ACCEPT)                                    # another purpose's keys cached first
    assert torch.equal(src.select(order).gumbel(pos[order], TOKEN, ids), full[order])
    sub = torch.tensor([299, 5, 17, 128])
    assert torch.equal(CounterNoise(seeds).gumbel(pos[:, 1:], TOKEN, sub), full[:, 1:][..., sub])
    monkeypatch.setattr(noise, "_CHUNK", 7)
    assert torch.equal(CounterNoise(seeds).gumbel(pos, TOKEN, ids), full)
    u = CounterNoise(seeds).uniform(pos, TOKEN, ids)
    assert torch.equal(-torch.log(-torch.log1p(-u)), full)
    assert not torch.equal(CounterNoise(seeds).gumbel(pos, DRAFT, ids), full)


def test_request_seeds():
    assert request_seed(3, 0) == request_seed(3, 0) != request_seed(3, 1)
    seeds = {request_seed(s, i) for s in range(100) for i in range(1000)}
    assert len(seeds) == 100_000 and all(0 <= s < 1 << 63 for s in seeds)
    assert resolve_request_seeds(3, 11, None) == [request_seed(11, i) for i in range(3)]
    assert resolve_request_seeds(2, None, [5, 2 ** 63 - 1]) == [5, 2 ** 63 - 1]
    assert resolve_request_seeds(2, None, None) != resolve_request_seeds(2, None, None)   # fresh randomness
    with pytest.raises(ValueError, match="both seed=1 and request_seeds"):
        resolve_request_seeds(1, 1, [1])
    with pytest.raises(ValueError, match="request_seeds has 1 entries for 2 prompts"):
        resolve_request_seeds(2, None, [1])
    for bad in (-1, 2 ** 63, True, 1.5):
        with pytest.raises(ValueError, match=r"request_seeds\[1\]="):
            resolve_request_seeds(2, None, [0, bad])
    with pytest.raises(ValueError, match="seed='x' must be an int"):
        resolve_request_seeds(1, "x", None)
