"""Structured outputs: a request's constraint (JSON schema, JSON object, regex, choice, Lark grammar) compiled by
llguidance into a matcher that gives, before each sampled token, the set of tokens that keep the output valid.

`grammar.py` turns a `StructuredOutputs` into llguidance's grammar and checks it (the API's 400s);
`compiler.py` keeps compiled grammars and hands each request its own matcher. The worker applies the masks
(meshserve/worker/grammar_masks.py).
"""
