"""A chat template that renders tools, for the tiny checkpoints: the released Qwen3-Omni templates are not at
hand, so the tests that need tools rendered (parity of the rendering, tool calls served end to end) carry this
one. It is a test fixture, not a checkpoint's template."""

import shutil
from pathlib import Path

# A template reaching for everything transformers' environment gives one (tojson with its options, loop
# controls, raise_exception, trimmed blocks); a test fixture, not a checkpoint's template.
TOOLS_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
  {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
  {%- if message.role not in ('system', 'user', 'assistant', 'tool') %}
    {{- raise_exception('unknown role ' + message.role) }}
  {%- endif %}
<|im_start|>{{ 'user' if message.role == 'tool' else message.role }}
{% if message.role == 'tool' %}<tool_response>
{{ message.content }}
</tool_response>
{%- elif message.content is string %}{{ message.content }}
{%- elif message.content %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}\
{% elif part.type in ('audio', 'input_audio', 'audio_url') %}<|audio_start|><|audio_pad|><|audio_end|>\
{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}
{%- endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def with_tools_template(checkpoint: Path, directory: Path) -> Path:
    """A copy of `checkpoint` in `directory` whose chat template is TOOLS_TEMPLATE."""
    shutil.copytree(checkpoint, directory, dirs_exist_ok=True)
    (directory / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return directory
