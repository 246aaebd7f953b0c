from lmdeploy_lite.pytorch.strategies.ar.strategy import ARStrategy

__all__ = ['ARStrategy']
