"""Speculative decoding: proposers (draft tokens), verification (rejection sampling), the spec agent."""
