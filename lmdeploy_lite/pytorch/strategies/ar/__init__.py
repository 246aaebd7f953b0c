"""Plain autoregressive decoding: the base Strategy as it is."""
from lmdeploy_lite.pytorch.strategies.base import Strategy


class ARStrategy(Strategy):
    pass
