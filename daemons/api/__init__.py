"""The API server: one aiohttp process of the N behind the node's port.

It owns a request's life from the HTTP edge to its last byte: decode and
validate (openai_types), tokenize (tokenizer), route (router, prefix_index),
send to a rank and collect its outputs (engine_client), detokenize and stop
(detokenizer), structured output (guided), the response (serving), limits on
what a client may cost (http_limits) and its counters (metrics). It never
imports torch or transformers' model code, so it starts in well under a second.
"""
