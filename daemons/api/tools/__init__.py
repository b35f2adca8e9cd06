"""Tool calling for /v1/chat/completions: tool definitions and tool_choice checked and
turned into a grammar (choice.py); the model's text parsed into tool calls (base.py,
parsers.py, over the resumable scans of scan.py); one choice's answer read through the
reasoning and tool parsers (answer.py). Nothing here knows HTTP."""
