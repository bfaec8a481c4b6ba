import itertools
import math

import numpy as np
import pytest

from ulysses_jax import plan_heads

CASES = [
    (h, hkv, p)
    for h, hkv, p in itertools.product([1, 2, 3, 4, 6, 8, 12, 14, 16, 24, 28, 32, 64], [1, 2, 3, 4, 8, 12], [1, 2, 4, 8])
    if h % hkv == 0
]


@pytest.mark.parametrize("h, hkv, p", CASES, ids=[f"H{h}-KV{k}-P{p}" for h, k, p in CASES])
def test_layout_is_valid_and_minimal(h, hkv, p):
    lay = plan_heads(h, hkv, p)
    g, kl = lay.group, lay.kv_per_device
    assert len(lay.q_slots) == p * kl * g and len(lay.kv_slots) == p * kl
    # every real query head appears exactly once
    real = [x for x in lay.q_slots if x >= 0]
    assert sorted(real) == list(range(h))
    # locally plain GQA: position i reads kv position i // g, which holds that query head's KV head
    for i, qh in enumerate(lay.q_slots):
        if qh >= 0:
            assert lay.kv_slots[i // g] == qh // (h // hkv)
    # attention compute per device is the least any plain-GQA layout reaches (never below ceil(H / P))
    assert lay.heads_per_device == _fewest_heads(h, hkv, p) >= math.ceil(h / p)
    assert lay.wasted_fraction == pytest.approx(1 - h / (p * lay.heads_per_device))
    if h % p == 0 and hkv % p == 0:
        assert lay.is_identity and lay.kv_heads_sent == hkv and lay.wasted_fraction == 0


def _fewest_heads(h, hkv, p):
    """Brute force over the group size g: a slot holds g query heads of one KV head, so KV head j needs
    ceil(G / g) slots, and the fullest device holds ceil(slots / P) of them."""
    G = h // hkv
    return min(math.ceil(hkv * math.ceil(G / g) / p) * g for g in range(1, G + 1))


@pytest.mark.parametrize(
    "h, hkv, p, q_dev, kv_dev, waste",
    [
        (32, 8, 8, 4, 1, 0.0),  # Llama-3 8B: contiguous
        (32, 2, 8, 4, 1, 0.0),  # kv heads < sp: each KV head copied to 4 devices
        (8, 1, 4, 2, 1, 0.0),  # MQA
        (6, 3, 2, 3, 3, 0.0),  # kv heads not dividing sp
        (12, 12, 8, 2, 2, 0.25),  # heads not divisible by sp
        (12, 4, 8, 2, 1, 0.25),
        (14, 2, 8, 2, 1, 0.125),  # Qwen2.5-0.5B
        (28, 4, 8, 4, 1, 0.125),  # Qwen2.5-7B
    ],
)
def test_documented_examples(h, hkv, p, q_dev, kv_dev, waste):
    lay = plan_heads(h, hkv, p)
    assert (lay.heads_per_device, lay.kv_per_device) == (q_dev, kv_dev)
    assert lay.wasted_fraction == pytest.approx(waste)


def test_gather_roundtrip():
    lay = plan_heads(12, 4, 8)
    x = np.arange(2 * 3 * 12 * 5, dtype=np.float32).reshape(2, 3, 12, 5)
    padded = np.asarray(lay.gather_q(x))
    assert padded.shape == (2, 3, 16, 5)
    np.testing.assert_array_equal(np.asarray(lay.ungather_out(padded)), x)
    dummies = [i for i, s in enumerate(lay.q_slots) if s < 0]
    assert dummies and np.all(padded[:, :, dummies] == 0)


def test_invalid():
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of kv heads \(4\)"):
        plan_heads(6, 4, 2)


@pytest.mark.parametrize("h, hkv, p", CASES, ids=[f"H{h}-KV{k}-P{p}" for h, k, p in CASES])
def test_head_groups_cover_every_slot_as_plain_gqa(h, hkv, p):
    """Every allowed group size (ModelConfig.attn_head_chunk): the groups' exchange slots are the device's slots,
    each exactly once, and within a group query slot i reads KV slot i // g, which holds its KV head; any other
    size is refused naming the allowed ones."""
    from ulysses_jax.parallel.head_layout import head_groups

    lay = plan_heads(h, hkv, p)
    hq, g = lay.heads_per_device, lay.group
    allowed = [d for d in range(1, hq + 1) if hq % d == 0 and (d % g == 0 or g % d == 0)]
    assert 1 in allowed and hq in allowed
    for size in range(1, hq + 2):
        if size not in allowed:
            with pytest.raises(ValueError, match=f"choose one of {', '.join(map(str, allowed))}, or 0 for one group"):
                head_groups(lay, size)
            continue
        groups = head_groups(lay, size)
        q, kv = groups.q_heads(), groups.kv_heads()
        assert q.shape == (hq // size, p * size) and kv.shape == (hq // size, p * groups.kv)
        # device j's part of group t's exchange: slots j*size .. ; together, device j's slots in order
        per_device = q.reshape(groups.count, p, size).transpose(1, 0, 2).reshape(p, hq)
        assert per_device.ravel().tolist() == list(lay.q_slots)
        local_g = min(size, g)  # query heads per KV head inside a group
        for t in range(groups.count):
            for j in range(p):
                for i in range(size):
                    qh = q[t, j * size + i]
                    if qh >= 0:
                        assert kv[t, j * groups.kv + i // local_g] == qh // (h // hkv)
    assert head_groups(lay, 0).count == 1
