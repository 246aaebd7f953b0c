"""Speculative decoding: draft proposers, verification (rejection sampling), the spec agent."""
