import scipy.stats
import torch

from lmdeploy_lite.pytorch.sampling import SamplingInputs, draw_from_probs, make_generator, probs_from_logits, sample


def _inputs(n, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, seeds=None):
    return SamplingInputs.from_values([do_sample] * n, [temperature] * n, [top_k] * n, [top_p] * n, seeds=seeds)


def test_greedy_equals_argmax_with_ties():
    logits = torch.randint(0, 4, (64, 50)).float()               # many ties
    tokens = sample(logits, SamplingInputs.greedy(64))
    assert torch.equal(tokens, logits.argmax(-1))
    probs = probs_from_logits(logits, SamplingInputs.greedy(64))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_temperature_zero_means_greedy():
    s = SamplingInputs.from_values([True, True], [0.0, 1.0], [0, 0], [1.0, 1.0])
    assert s.do_sample.tolist() == [False, True]


def test_top_k_mask():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = probs_from_logits(logits, _inputs(1, top_k=2))
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.tensor([5.0, 4.0]).softmax(-1)
    torch.testing.assert_close(probs[0], expected)


def test_top_p_mask():
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()[None]
    keep_two = probs_from_logits(logits, _inputs(1, top_p=0.6))[0]
    torch.testing.assert_close(keep_two, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    keep_three = probs_from_logits(logits, _inputs(1, top_p=0.8))[0]
    assert (keep_three > 0).tolist() == [True, True, True, False]
    keep_one = probs_from_logits(logits, _inputs(1, top_p=0.01))[0]   # the top token always stays
    assert keep_one.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]], dtype=torch.float64)
    probs = probs_from_logits(logits, _inputs(1, temperature=0.5, top_k=3, top_p=0.9))[0]
    scaled = (logits[0, :3] / 0.5).softmax(-1)                   # top-3 after temperature
    kept = scaled[:2] if scaled[0] + scaled[1] >= 0.9 else scaled
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:len(kept)] = kept / kept.sum()
    torch.testing.assert_close(probs, expected)
    assert probs.dtype == torch.float64


def test_mixed_batch_rows_keep_their_own_parameters():
    logits = torch.randn(3, 100)
    s = SamplingInputs.from_values([False, True, True], [1.0, 1.0, 1.0], [0, 1, 0], [1.0, 1.0, 1.0])
    tokens = sample(logits, s)
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()   # top_k=1 is greedy
    probs = probs_from_logits(logits, s)
    torch.testing.assert_close(probs[2], logits[2].softmax(-1))


def test_same_seed_same_samples_different_seed_different():
    logits = torch.zeros(1, 1000)
    def run(seed):
        s = _inputs(1, seeds=[seed])
        return [sample(logits, s).item() for _ in range(20)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_row_samples_do_not_depend_on_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    alone = SamplingInputs.from_values([True], [0.8], [50], [0.95], generators=[make_generator(11)])
    mixed = SamplingInputs.from_values([True, False, True, True], [1.3, 1.0, 0.8, 1.0], [0, 0, 50, 0],
                                       [1.0, 1.0, 0.95, 0.5],
                                       generators=[None, make_generator(3), make_generator(11), make_generator(5)])
    for _ in range(10):
        assert sample(logits[2:3], alone).item() == sample(logits, mixed)[2].item()


def test_sample_follows_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    n = 20000
    tokens = sample(probs.log().expand(n, -1), _inputs(n))
    counts = torch.bincount(tokens, minlength=5)
    assert counts[4] == 0
    assert scipy.stats.chisquare(counts[:4].numpy(), (probs[:4] * n).numpy()).pvalue > 0.01


def test_draw_from_probs_unnormalised_rows():
    probs = torch.tensor([[0.0, 0.0, 3.0], [2.0, 0.0, 0.0]])
    assert draw_from_probs(probs, [None, make_generator(1)]).tolist() == [2, 0]
