"""On GPUs (issue 34): the ranks of one host meet through a FileStore and pin gloo / NCCL /
NVSHMEM sockets to loopback. Starts the embedded model at dp2 ep2 (DeepEP when carried) with the
MTP draft, generates, and prints every TCP socket the rank processes listen on; exits 1 if one
is not on a loopback address."""
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
    from tests.serve.live_server import is_loopback_hex, listening
    cfg = PytorchEngineConfig(dp=2, ep=2, device='cuda', max_batch_size=8, session_len=512)
    with pipeline(None, cfg, SpeculativeConfig(num_speculative_tokens=3), progress=False) as pipe:
        out = pipe(['def main(', 'import os'], GenerationConfig(max_new_tokens=16))
        pids = [p.pid for p in multiprocessing.active_children()]
        sockets = listening([os.getpid(), *pids])
    print('tokens', [len(r.token_ids) for r in out], 'rank pids', pids)
    print('listening', [(a, port, is_loopback_hex(a)) for a, port in sockets])
    bad = [s for s in sockets if not is_loopback_hex(s[0])]
    print('non-loopback listeners:', bad or 'none')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
