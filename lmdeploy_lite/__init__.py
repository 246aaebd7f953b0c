"""lmdeploy_lite: Qwen3.5 inference with MTP speculative decoding under TP/DP/EP."""
from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig, Response,
                                    SpeculativeConfig)

__version__ = '0.1.0'
__all__ = ['pipeline', 'Pipeline', 'GenerationConfig', 'PytorchEngineConfig', 'SpeculativeConfig',
           'Response']


def __getattr__(name):
    # torch and the engine load on first use, so `import lmdeploy_lite` and `--help` stay fast
    if name in ('pipeline', 'Pipeline'):
        from lmdeploy_lite import api
        return getattr(api, name)
    raise AttributeError(name)
