"""The OpenAI endpoints of one API server, as one object: completions, chat, models
and vLLM's utility endpoints.

server.py routes to these methods; the serving base (serving.py) holds what they
share, and the endpoint modules (completions.py, chat.py, utility.py) what each owns.
"""

from __future__ import annotations

from dpserve.daemons.api.chat import ChatServing
from dpserve.daemons.api.completions import CompletionsServing
from dpserve.daemons.api.utility import UtilityServing


class OpenAIServing(UtilityServing, CompletionsServing, ChatServing):
    """completions, chat_completions, models and the utility endpoints, for one API server's app."""
