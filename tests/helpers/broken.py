"""Deliberately broken engines for the multi-process tests (loaded through
LMDEPLOY_LITE_WORKER_HOOK='tests.helpers.broken:<name>')."""
import torch


def skip_dummy_draft(engine):
    """An idle rank skips its dummy draft forwards: the bug class of vLLM #35248."""
    proposer = engine.agent.proposer
    real = proposer.propose

    def propose(inputs, hidden, next_ids, rows, sampling):
        if inputs.is_dummy:
            return torch.zeros(rows.numel(), proposer.num_spec_tokens, dtype=torch.long), None
        return real(inputs, hidden, next_ids, rows, sampling)
    proposer.propose = propose
