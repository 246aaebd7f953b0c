from lmdeploy_lite.pytorch.strategies.ar_spec.strategy import ARSpecStrategy

__all__ = ['ARSpecStrategy']
