"""Tool calling for /v1/chat/completions: tool definitions and tool_choice checked and
turned into a grammar (choice.py), and the model's text parsed into tool calls
(parsers.py, over the resumable scans of scan.py). Nothing here knows HTTP."""
