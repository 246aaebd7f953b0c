"""Where an engine's ranks run, behind one `EngineClient` (client.py)."""
from __future__ import annotations

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.executor.client import EngineClient


def connect(model_path: str, engine_config: PytorchEngineConfig,
            speculative_config: SpeculativeConfig | None = None, tokenizer=None,
            progress: bool = True, engine_process: bool = False) -> EngineClient:
    """One ray actor per rank (backend 'ray'), one process per rank (tp * dp > 1, or
    `engine_process`), else one engine in a thread of this process."""
    if engine_config.distributed_executor_backend == 'ray':
        from lmdeploy_lite.pytorch.engine.executor.ray import RayEngineLoop
        return RayEngineLoop(model_path, engine_config, speculative_config)
    if engine_config.tp * engine_config.dp > 1 or engine_process:
        from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
        return MPEngineLoop(model_path, engine_config, speculative_config)
    from lmdeploy_lite.pytorch.engine.build import build_engine
    from lmdeploy_lite.pytorch.engine.executor.thread import EngineLoop
    return EngineLoop(build_engine(model_path, engine_config, speculative_config,
                                   tokenizer=tokenizer, progress=progress))
