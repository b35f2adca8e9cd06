"""The demo model's chat templates: plain ChatML, and a Hermes / Qwen-style one with tools and thinking.

The "tools" template renders what tool-calling and reasoning models' templates do
(Qwen2.5 / Qwen3 / Hermes 2 Pro): the tool list in the system turn, assistant
tool calls as <tool_call> JSON, tool results as <tool_response> user turns, and
a <think> block the model opens itself (enable_thinking=false writes an empty
one, as Qwen3's template does). Its tags are ordinary added tokens (not special),
so they survive skip_special_tokens and the parsers see them in the text.
Must never change for a released VERSION: nodes build the same bytes.
"""

from __future__ import annotations

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
# Trained as added tokens of the "tools" tokenizer (ids 4..7, after the special tokens).
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, THINK_START, THINK_END)
CHAT_TEMPLATES = ("plain", "tools")

# Renders the BOS itself, like Llama 3's template: callers encode the rendered
# chat with add_special_tokens=False (what transformers' apply_chat_template
# and vLLM do), plain completions with it, and get exactly one BOS either way.
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS_TEMPLATE = """{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content and loop.last %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if loop.first and message.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


def chat_template(kind: str) -> str:
    if kind not in CHAT_TEMPLATES:
        raise ValueError(f"unknown demo chat template {kind!r} (one of {', '.join(CHAT_TEMPLATES)})")
    return TOOLS_TEMPLATE if kind == "tools" else PLAIN_TEMPLATE
