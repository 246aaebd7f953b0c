"""No Triton kernel compiles inside a served step: after start-up (graph capture, then the eager
warm-up, ModelAgent.warm_eager) and one first call, steps of the shapes a server meets next
compile nothing: batches of 64-token prompts in every split class of the prefill attention,
odd lengths, two chunks over 512 tokens in one step (fla's varlen form), long prompts. A compile
stalls every stream: 1-2.5 s for each attention variant the MTP head's eager pass met, 40 s for
fla's varlen form, on an H200 before the warm-up (BENCHMARKS.md, "No kernel compiles inside a
served step"; benchmarks/bench_first_shapes.py measures the same on a preset). The embedded
model in bf16, plain and MTP k=3. Skipped without CUDA."""
import pytest
import torch

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers import accepting

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# (prompts, tokens each), as bench_first_shapes.SHAPES
SHAPES = [(13, 64), (31, 64), (63, 64), (15, 64), (27, 64), (7, 64), (3, 67), (33, 67),
          (2, 1000), (1, 3000), (9, 333), (40, 77)]


@pytest.mark.parametrize('k', [0, 3])
def test_no_kernel_compiles_after_start_up(k, monkeypatch):
    import triton.runtime.jit as jit
    cfg = PytorchEngineConfig(dtype='bfloat16', device='cuda', session_len=4096,
                              max_batch_size=64)
    engine = build_engine(EMBEDDED_MODEL_DIR, cfg, accepting.spec(k), progress=False)
    generator, vocab = torch.Generator().manual_seed(0), engine.model_config.vocab_size
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(0, vocab, (length,), generator=generator).tolist()
                for _ in range(n)]
    engine.generate(prompts(64, 64), gen)             # the first call (as the benchmark's)
    compiled, real = [], jit.JITFunction._do_compile

    def logged(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(jit.JITFunction, '_do_compile', logged)
    for n, length in SHAPES:
        engine.generate(prompts(n, length), gen)
        assert not compiled, (n, length, sorted(set(compiled)))
