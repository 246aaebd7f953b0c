import pytest
import torch

from lmdeploy_lite.pytorch.spec_decode.proposers import NgramProposer


@pytest.mark.parametrize('tokens, expected', [
    ([1, 2, 3, 4, 5, 1, 2], [3, 4, 5]),                 # suffix [1, 2] seen before: copy what followed
    ([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], [7, 8, 2]),     # most recent earlier occurrence of [2, 3] wins
    ([4, 1, 2, 9, 5, 2, 8, 1, 2], [9, 5, 2]),           # longest suffix ([1, 2]) beats [2] (-> 8)
    ([1, 2, 1, 2], [1, 2, 1]),                          # match overlapping the end continues the pattern
    ([7, 7], [7, 7, 7]),
    ([5, 6, 7], [7, 7, 7]),                             # no match: repeat the last token
    ([3], [3, 3, 3]),
    ([], [0, 0, 0]),
])
def test_propose(tokens, expected):
    assert NgramProposer(3).propose(tokens) == expected


def test_min_n_and_max_n():
    tokens = [1, 2, 3, 8, 2, 3, 9, 3]
    assert NgramProposer(2, min_n=1, max_n=4).propose(tokens) == [9, 3]      # [3] most recent at 5
    assert NgramProposer(2, min_n=2, max_n=4).propose(tokens) == [3, 3]      # [9, 3] unseen: no match
    assert NgramProposer(2, min_n=1, max_n=1).propose([1, 2, 3, 1, 2]) == [3, 1]


def test_propose_batch():
    drafts = NgramProposer(2).propose_batch([[1, 2, 3, 1, 2], [4]])
    assert drafts.dtype == torch.long and drafts.tolist() == [[3, 1], [4, 4]]


def test_bad_config():
    with pytest.raises(ValueError, match='num_speculative_tokens=0'):
        NgramProposer(0)
    with pytest.raises(ValueError, match='min_n=3'):
        NgramProposer(2, min_n=3, max_n=2)
