import pytest
import scipy.stats
import torch

from lmdeploy_lite.pytorch.sampling import SamplingInputs, make_generator, probs_from_logits
from lmdeploy_lite.pytorch.spec_decode.rejection import (acceptance_by_position, greedy_verify,
                                                         rejection_sample)

VOCAB = 10


def peaked_logits(target_tokens):
    """[B, k+1] token ids -> logits [B, k+1, VOCAB] whose argmax (and only finite entry) is each id."""
    logits = torch.full((*torch.tensor(target_tokens).shape, VOCAB), float('-inf'))
    return logits.scatter_(-1, torch.tensor(target_tokens)[..., None], 0.0)


def greedy(n):
    return SamplingInputs.greedy(n)


def sampled(n, temperature=0.8, seeds=None):
    return SamplingInputs.from_values([True] * n, [temperature] * n, [0] * n, [1.0] * n, seeds=seeds)


TARGET = [[5, 6, 7, 8]]


@pytest.mark.parametrize('make_sampling', [greedy, sampled])
@pytest.mark.parametrize('drafts, expected, num_accepted', [
    ([[5, 6, 7]], [5, 6, 7, 8], 3),             # all accepted + bonus
    ([[1, 6, 7]], [5, -1, -1, -1], 0),          # first rejected: correction 5
    ([[5, 9, 7]], [5, 6, -1, -1], 1),           # middle rejected: correction 6
    ([[5, 6, 1]], [5, 6, 7, -1], 2),            # last rejected
])
def test_hand_made_cases(make_sampling, drafts, expected, num_accepted):
    # peaked (one-hot) targets make sampled rows deterministic too: p(d) is 1 or 0.
    draft_probs = torch.full((1, 3, VOCAB), 1.0 / VOCAB)
    tokens, accepted = rejection_sample(peaked_logits(TARGET), torch.tensor(drafts), draft_probs, make_sampling(1))
    assert tokens.tolist() == [expected] and accepted.tolist() == [num_accepted]


def test_greedy_uses_raw_logits_argmax():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]])
    tokens, accepted = rejection_sample(logits, torch.tensor([[1]]), None, greedy(1))
    assert tokens.tolist() == [[1, 0]] and accepted.tolist() == [1]


def test_mixed_greedy_and_sampled_rows():
    target = [[5, 6, 7, 8], [1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]]
    drafts = torch.tensor([[5, 6, 7], [1, 9, 3], [5, 6, 9], [1, 2, 3]])
    sampling = SamplingInputs.from_values([False, True, False, True], [1.0, 0.7, 1.0, 1.2], [0, 5, 0, 0],
                                          [1.0, 0.9, 1.0, 1.0], seeds=[None, 1, None, 2])
    tokens, accepted = rejection_sample(peaked_logits(target), drafts, torch.rand(4, 3, VOCAB), sampling)
    assert tokens.tolist() == [[5, 6, 7, 8], [1, 2, -1, -1], [5, 6, 7, -1], [1, 2, 3, 4]]
    assert accepted.tolist() == [3, 1, 2, 3]


@pytest.mark.parametrize('make_sampling', [greedy, sampled])
def test_num_drafts_shorter_than_k(make_sampling):
    target = [[5, 6, 7, 8]] * 3
    drafts = torch.tensor([[5, 6, -1], [5, -1, -1], [5, 6, 7]])    # -1: placeholder, not a real draft
    num_drafts = torch.tensor([2, 0, 1])
    tokens, accepted = rejection_sample(peaked_logits(target), drafts, None, make_sampling(3), num_drafts)
    # bonus comes from the position right after the last real draft
    assert tokens.tolist() == [[5, 6, 7, -1], [5, -1, -1, -1], [5, 6, -1, -1]]
    assert accepted.tolist() == [2, 0, 1]


def test_zero_target_probability_is_never_accepted():
    # top_k=1 makes the target one-hot at 3 even though the logits are nearly flat
    logits = torch.tensor([[[1.0, 1.0, 1.0, 1.1]] * 2])
    sampling = SamplingInputs.from_values([True], [1.0], [1], [1.0])
    for _ in range(20):
        tokens, accepted = rejection_sample(logits, torch.tensor([[0]]), torch.tensor([[[1.0, 0, 0, 0]]]), sampling)
        assert tokens.tolist() == [[3, -1]] and accepted.item() == 0


def test_row_result_does_not_depend_on_batch():
    torch.manual_seed(0)
    logits, q = torch.randn(3, 4, VOCAB), torch.rand(3, 3, VOCAB).softmax(-1)
    drafts = torch.randint(0, VOCAB, (3, 3))
    def run(rows, seeds):
        s = SamplingInputs.from_values([True] * len(rows), [0.9] * len(rows), [0] * len(rows), [1.0] * len(rows),
                                       generators=[make_generator(x) for x in seeds])
        return [rejection_sample(logits[rows], drafts[rows], q[rows], s)[0][rows.index(1)].tolist() for _ in range(8)]
    assert run([1], [42]) == run([0, 1, 2], [None, 42, 7]) == run([2, 1], [3, 42])


def test_acceptance_by_position():
    accepted, drafted = acceptance_by_position(torch.tensor([3, 0, 1]), torch.tensor([3, 2, 1]), 3)
    assert accepted.tolist() == [2, 1, 1] and drafted.tolist() == [3, 2, 1]


# ---- distribution tests: every emitted token follows the target distribution p -------------------
N = 50000
# three positions (k=2) with different p; q differs: q>p, q<p, q=p and q=0 where p>0, q>0 where p=0
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.10, 0.15, 0.20, 0.25, 0.25],
                  [0.50, 0.20, 0.10, 0.10, 0.05, 0.05]], dtype=torch.float64)
Q = torch.tensor([[0.10, 0.40, 0.00, 0.15, 0.15, 0.20],
                  [0.30, 0.00, 0.15, 0.05, 0.25, 0.25]], dtype=torch.float64)
MIN_SAMPLES = 2000
P_VALUE = 0.001        # per check; 18 checks (6 cases x 3 positions): ~2% false alarms if reseeded


def assert_follows(tokens, expected_probs):
    counts = torch.bincount(tokens.cpu(), minlength=expected_probs.numel()).double()
    assert counts.sum() >= MIN_SAMPLES, f'only {int(counts.sum())} samples: the test lost its power'
    expected_probs = expected_probs.cpu()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, 'emitted a token the target gives probability 0'
    expected = expected_probs[support] * counts.sum()
    assert scipy.stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue > P_VALUE


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.gpu)])
@pytest.mark.parametrize('temperature, top_k, top_p', [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0)])
@pytest.mark.parametrize('stochastic_drafts', [True, False])
def test_emitted_tokens_follow_target(temperature, top_k, top_p, stochastic_drafts, device):
    """Each emitted position follows the (temperature/top-k/top-p shaped) target p exactly: the
    first token (accepted draft 1 or its correction), the second given draft 1 was accepted, and
    the bonus given both were. One batched call of N = 50,000 rows on the same p and q.

    Power: position 0 has N samples, the later ones the rows that accepted (>= MIN_SAMPLES,
    asserted); df = support - 1 <= 5; each check passes at p-value > 0.001. With N = 50,000 and
    df = 5 that catches a deviation of Cohen's w = sqrt(sum (p' - p)^2 / p) >= 0.024 with power
    0.9 (w >= 0.12 at 2,000 samples). A token with p = 0 must never appear."""
    torch.manual_seed(1234)
    logits = P.log().to(device).expand(N, -1, -1)
    sampling = SamplingInputs.from_values([True] * N, [temperature] * N, [top_k] * N, [top_p] * N,
                                          device=device)
    p = probs_from_logits(logits[:1], SamplingInputs.from_values(
        [True], [temperature], [top_k], [top_p], device=device))[0]
    if stochastic_drafts:            # drafts sampled from q, draft_probs = q
        q = Q.to(device)
        draft_probs = q.expand(N, -1, -1)
        drafts = torch.multinomial(q, N, replacement=True).T.contiguous()
    else:                            # deterministic drafts (q one-hot): always propose 0 then 5
        draft_probs, drafts = None, torch.tensor([0, 5], device=device).expand(N, -1)
    tokens, accepted = rejection_sample(logits, drafts, draft_probs, sampling)
    assert_follows(tokens[:, 0], p[0])
    assert_follows(tokens[accepted >= 1, 1], p[1])      # second token, given the first was accepted
    assert_follows(tokens[accepted == 2, 2], p[2])      # bonus token, given both were accepted


# ---- a reduced draft vocabulary: q over a token map's M ids ([B, k, M]), zero at every other id ----
# 'without_the_likeliest' leaves out token 0, which p gives 0.30 / 0.05 / 0.50 (and token 2); the
# drafts then never propose it, and every emitted 0 comes from a correction or the bonus
MAPS = {'without_the_likeliest': [4, 1, 3, 5], 'whole_vocab_permuted': [5, 3, 0, 1, 4, 2]}


def map_q(token_map):
    """Q restricted to the map's ids (in map order) and renormalized: [k, M]."""
    q = Q[:, token_map]
    return q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.gpu)])
@pytest.mark.parametrize('temperature, top_k, top_p', [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0)])
@pytest.mark.parametrize('map_name', list(MAPS))
def test_emitted_tokens_follow_target_with_a_token_map(map_name, temperature, top_k, top_p, device):
    """test_emitted_tokens_follow_target with drafts sampled from q over a token map (the MTP
    draft with SpeculativeConfig.draft_token_map): the same power, the same three positions."""
    torch.manual_seed(4321)
    token_map = torch.tensor(MAPS[map_name], device=device)
    logits = P.log().to(device).expand(N, -1, -1)
    sampling = SamplingInputs.from_values([True] * N, [temperature] * N, [top_k] * N, [top_p] * N,
                                          device=device)
    p = probs_from_logits(logits[:1], SamplingInputs.from_values(
        [True], [temperature], [top_k], [top_p], device=device))[0]
    q = map_q(MAPS[map_name]).to(device)
    drafts = token_map[torch.multinomial(q, N, replacement=True).T.contiguous()]
    tokens, accepted = rejection_sample(logits, drafts, q.expand(N, -1, -1), sampling,
                                        token_map=token_map)
    assert set(drafts.unique().tolist()) <= set(MAPS[map_name])
    assert_follows(tokens[:, 0], p[0])
    assert_follows(tokens[accepted >= 1, 1], p[1])
    assert_follows(tokens[accepted == 2, 2], p[2])
    if map_name == 'without_the_likeliest':     # the target still emits what the draft cannot
        assert (tokens[:, 0] == 0).float().mean() > 0.25


@pytest.mark.parametrize('map_name', list(MAPS))
def test_a_token_map_equals_q_scattered_over_the_vocabulary(map_name):
    """Row for row, with the same generators: q kept over the map plus the map gives exactly
    what the same q written out over the whole vocabulary (zero off the map) gives."""
    rows, token_map = 256, torch.tensor(MAPS[map_name])
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, 3, P.shape[1], generator=gen, dtype=torch.float64)
    q = torch.rand(rows, 2, len(token_map), generator=gen, dtype=torch.float64).softmax(-1)
    drafts = token_map[torch.randint(len(token_map), (rows, 2), generator=gen)]
    q_full = torch.zeros(rows, 2, P.shape[1], dtype=torch.float64).scatter_(
        -1, token_map.expand(rows, 2, -1), q)

    def sampling():
        return SamplingInputs.from_values([True] * rows, [0.9] * rows, [0] * rows, [1.0] * rows,
                                          seeds=list(range(rows)))
    got = rejection_sample(logits, drafts, q, sampling(), token_map=token_map)
    want = rejection_sample(logits, drafts, q_full, sampling())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int(got[1].sum()) < 2 * rows         # some drafts accepted, some rejected


def test_greedy_verify_equals_the_general_path():
    """The all-greedy fast path against the general one run with greedy rows (all_greedy=False
    forces it): same tokens and counts, with num_drafts below k and -1 placeholders past it."""
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 4, 6
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, argmax[:, :k],
                         torch.randint(0, vocab, (batch, k), generator=gen))
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    drafts = torch.where(torch.arange(k) < num_drafts[:, None], drafts, -1)
    greedy = SamplingInputs.greedy(batch)
    general = SamplingInputs(greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p,
                             greedy.generators, all_greedy=False, needs_filter=False)
    want = rejection_sample(logits, drafts, None, general, num_drafts)
    got = greedy_verify(logits, drafts, num_drafts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[1] > 0).any() and (got[1] < num_drafts).any()      # both kinds of rows
