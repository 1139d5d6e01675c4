"""Speculative decoding on the worker: acceptance (rejection sampler), verify rows, the MTP drafter and proposer."""
