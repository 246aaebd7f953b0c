"""Draft-token proposers."""
from .ngram import NgramProposer

__all__ = ['NgramProposer']
