"""A test-made copy of stories260K that renders tools and "thinks", for end-to-end tool and reasoning tests.

The tiny model never writes tool-call tags or `</think>` on its own, so the copy changes only text, never
weights or token ids:
- `chat_template.jinja` lists the request's tools (as JSON, one per line), renders assistant tool calls
  as `<tool_call>{...}</tool_call>`, and opens `<think>` in the generation prompt, as DeepSeek-R1's
  templates do;
- the vocabulary spells token `THINK_END_ID` (" said" in the original, which the model writes early
  after `"Hello,"`) as `</think>`: where the model picks that token, the text really contains the end
  tag, as a single token, the way Qwen3 and DeepSeek-R1 vocabularies hold it. The merge that built
  " said" goes, so no prompt encodes to it.
Greedy token ids are those of the original model; only their text differs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

THINK_END_ID = 336
_ORIGINAL_PIECE = "▁said"
_COPIED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json")
TEMPLATE = (
    "{%- if tools %}tools:{{ '\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{% endif -%}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>{{ '\\n' }}{% endif %}"
)


def write_thinking_model(source: Path, folder: Path) -> Path:
    """Write the copy of the stories260K folder `source` into `folder` and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        shutil.copyfile(source / name, folder / name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert vocab.pop(_ORIGINAL_PIECE) == THINK_END_ID
    vocab["</think>"] = THINK_END_ID
    tokenizer["model"]["merges"] = [
        pair for pair in tokenizer["model"]["merges"] if "".join(pair) != _ORIGINAL_PIECE
    ]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder
