"""spec/verify.py: greedy acceptance exact, sampled acceptance preserving the target distribution
(measured over many draws with a fixed seed, against a bound a wrong sampler misses), batched over
sequences with different draft lengths in fixed shapes."""

from __future__ import annotations

import torch

from moetier.spec.verify import PAD, greedy_accept, rejection_accept


def test_greedy_keeps_the_matching_run_and_adds_the_target_token():
    v = 10
    best = torch.tensor([[3, 4, 5, 6], [1, 2, 7, 8], [9, 9, 9, 9], [0, 1, 2, 3]])  # target argmax per position
    logits = torch.nn.functional.one_hot(best, v).float() * 5 + torch.randn(4, 4, v) * 0.1
    draft = torch.tensor([[3, 4, 5], [1, 0, 7], [2, 9, 9], [0, 1, 2]])
    lens = torch.tensor([3, 3, 3, 1])  # the last drafted one token only: 1, 2 are padding
    accepted, tokens = greedy_accept(draft, lens, logits)
    assert accepted.tolist() == [3, 1, 0, 1]
    assert tokens.tolist() == [[3, 4, 5, 6], [1, 2, PAD, PAD], [9, PAD, PAD, PAD], [0, 1, PAD, PAD]]


def test_greedy_equals_plain_greedy_decoding():
    """A toy target (next token = f(previous)) decoded with noisy drafts gives plain greedy's tokens."""
    g = torch.Generator().manual_seed(0)
    v, k = 17, 3
    table = torch.randint(0, v, (v,), generator=g)
    plain = [5]
    for _ in range(40):
        plain.append(int(table[plain[-1]]))
    out = [5]
    while len(out) < len(plain):
        good = [int(table[out[-1]])]
        for _ in range(k - 1):
            good.append(int(table[good[-1]]))
        draft = torch.tensor([good])
        draft[0, 2] = (draft[0, 2] + int(torch.randint(0, 2, (1,), generator=g))) % v  # sometimes wrong
        ctx = [out[-1]] + draft[0].tolist()
        logits = torch.nn.functional.one_hot(table[torch.tensor(ctx)], v).float()[None]
        accepted, tokens = greedy_accept(draft, torch.tensor([k]), logits)
        out += tokens[0, :int(accepted[0]) + 1].tolist()
    assert out[:len(plain)] == plain


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _setup(v=6, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    return p, q


def test_rejection_sampling_preserves_the_target_distribution():
    """The first emitted token is distributed as p_0, and the second (after a kept first draft) as
    p_1: total variation under 0.01 over 200k draws, while the drafts' own distribution is far."""
    n, v, k = 200_000, 6, 2
    p, q = _setup(v, k)
    assert 0.5 * float((p[0] - q[0]).abs().sum()) > 0.15  # the bound below can fail
    g = torch.Generator().manual_seed(7)
    draft = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    accepted, tokens = rejection_accept(draft, torch.full((n,), k), p.expand(n, -1, -1), q.expand(n, -1, -1),
                                        generator=g)
    first = torch.bincount(tokens[:, 0], minlength=v).double()
    assert _tv(first, p[0].double()) < 0.01
    assert _tv(torch.bincount(draft[:, 0], minlength=v).double(), p[0].double()) > 0.1  # a sampler that keeps all
    kept = accepted >= 1
    second = torch.bincount(tokens[kept, 1], minlength=v).double()
    assert _tv(second, p[1].double()) < 0.01
    assert (tokens[:, 0] == draft[:, 0])[kept].all()
    # acceptance of draft 0 is sum_x min(p, q) (the overlap), within sampling error
    assert abs(float(kept.double().mean()) - float(torch.minimum(p[0], q[0]).sum())) < 0.01


def test_rejection_with_deterministic_drafts_and_the_bonus_token():
    """n-gram drafts (no q): kept with probability p(x); all kept: the bonus token drawn from p_K."""
    n, v, k = 100_000, 5, 2
    p, _ = _setup(v, k, seed=3)
    draft = torch.tensor([[int(p[0].argmax()), int(p[1].argmax())]]).expand(n, -1)
    g = torch.Generator().manual_seed(11)
    accepted, tokens = rejection_accept(draft, torch.full((n,), k), p.expand(n, -1, -1), generator=g)
    assert _tv(torch.bincount(tokens[:, 0], minlength=v).double(), p[0].double()) < 0.01
    all_kept = accepted == k
    assert abs(float(all_kept.double().mean()) - float(p[0].max() * p[1].max())) < 0.01
    assert _tv(torch.bincount(tokens[all_kept, k], minlength=v).double(), p[k].double()) < 0.02


def test_rejection_batches_different_draft_lengths():
    """Sequences with 0, 1 and 2 drafts in one call: a sequence with no draft samples p_0; entries
    past each draft's length never count; the shapes stay [B, K + 1]."""
    v, k, n = 4, 2, 60_000
    p, q = _setup(v, k, seed=5)
    lens = torch.tensor([0, 1, 2]).repeat(n)
    g = torch.Generator().manual_seed(2)
    draft = torch.multinomial(q[0], 3 * n * k, replacement=True, generator=g).view(3 * n, k)
    draft[torch.arange(k)[None, :] >= lens[:, None]] = PAD  # padding past each draft: never read
    accepted, tokens = rejection_accept(draft, lens, p.expand(3 * n, -1, -1), q[:1].expand(3 * n, k, -1),
                                        generator=g)
    assert tokens.shape == (3 * n, k + 1) and (accepted <= lens).all()
    none = lens == 0
    assert (accepted[none] == 0).all()
    assert _tv(torch.bincount(tokens[none, 0], minlength=v).double(), p[0].double()) < 0.015
    one = (lens == 1) & (accepted == 1)
    assert _tv(torch.bincount(tokens[one, 1], minlength=v).double(), p[1].double()) < 0.02  # the bonus
    j = torch.arange(k + 1)[None, :]
    assert ((tokens == PAD) == (j > accepted[:, None])).all()


def test_identical_draft_and_target_keep_everything():
    v, k, n = 8, 3, 500
    p = torch.softmax(torch.randn(k + 1, v, generator=torch.Generator().manual_seed(4)), -1)
    g = torch.Generator().manual_seed(1)
    draft = torch.stack([torch.multinomial(p[j], n, replacement=True, generator=g) for j in range(k)], 1)
    accepted, tokens = rejection_accept(draft, torch.full((n,), k), p.expand(n, -1, -1), p[:k].expand(n, -1, -1),
                                        generator=g)
    assert (accepted == k).all() and (tokens[:, :k] == draft).all() and (tokens[:, k] >= 0).all()
