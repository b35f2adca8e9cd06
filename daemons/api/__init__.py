"""The API server: one aiohttp process of the N behind the node's port.

It owns a request's life from the HTTP edge to its last byte:
- server.py: the process (sockets it was handed, the app, lifecycle);
  http_limits.py: what a client may cost (connections, bodies, timeouts);
- openai_types.py (the types) and request_checks.py (decode and validate);
  openapi.py, the document generated from those types;
- serving.py: the base of every endpoint (auth middleware, pinning,
  send/wait, failures, the metrics-and-abort wrapper); completions.py and
  chat.py on top; endpoints.py joins them;
- generation.py: a request's whole state (Generation, resubmittable) and the
  one detokenize-and-stop generator; one_choice.py renders the plain fast
  path, many_choices.py n / batched prompts / echo / structured output,
  logprobs.py the log-probabilities;
- tokenizer.py, detokenizer.py, guided.py (structured output);
- engine_client.py (the sockets to the ranks; engine_peers.py, which
  connection speaks for which rank), router.py and prefix_index.py
  (where a request goes), metrics.py.
It never imports torch or transformers' model code, so it starts in well under
a second.
"""
