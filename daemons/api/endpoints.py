"""The OpenAI endpoints of one API server, as one object: completions, chat and models.

server.py routes to these methods; the serving base (serving.py) holds what they
share, and the endpoint modules (completions.py, chat.py) what each owns.
"""

from __future__ import annotations

from dpserve.daemons.api.chat import ChatServing
from dpserve.daemons.api.completions import CompletionsServing


class OpenAIServing(CompletionsServing, ChatServing):
    """completions, chat_completions and models, for one API server's app."""
