# vLLM's vendored tests (tests/) run only through run.py, against a server it starts, in vLLM's venv.
collect_ignore = ["tests", "adapter", "run.py"]
