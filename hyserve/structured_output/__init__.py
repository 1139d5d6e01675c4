"""Structured output: a request's grammar (JSON schema, JSON object, regex, choice, Lark / GBNF grammar) compiled by
llguidance, its matcher advanced by the request's accepted tokens on the host, and the allowed-token bitmask of each
sampled position sent with the step (plain data) for the worker to apply to the logits on the device.

- ``params``: ``StructuredOutputsParams`` (vLLM's name and fields), validated.
- ``grammar``: the request's constraint as an llguidance grammar, and the tokenizer llguidance masks over.
- ``matcher``: ``GrammarMatcher`` (one request's state: consume accepted tokens, masks for a row's positions with
  its drafts consumed tentatively and rolled back) and the packed-bitmask helpers the worker unpacks.
"""
