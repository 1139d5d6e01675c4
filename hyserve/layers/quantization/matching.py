"""Layer names against a ``quantization_config``'s lists (``targets``, ``ignore``, ``modules_to_not_convert``).

Lists name modules the way the checkpoint does. hyserve's model-side names are ``Qwen3_5ForCausalLM``'s
(``model.layers.0.mlp.down_proj``); a Qwen3.5 VLM-form checkpoint names the same module
``model.language_model.layers.0.mlp.down_proj``. A name is matched in the checkpoint's own form first and then in
the other form too: both name one module, and some releases list names in the other form (transformers issue 48349,
docs/fp8_facts.md section 7). ``mtp.*`` names are the same in both forms.

Entry semantics (docs/fp8_facts.md section 5): ``re:PATTERN`` is Python ``re.match`` on the name (anchored at the
start only); ``Linear`` (a class name) matches every linear layer; anything else must equal the name.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

TEXT_PREFIX = "model."
VLM_TEXT_PREFIX = "model.language_model."
LINEAR_CLASS = "Linear"


@dataclass(frozen=True, slots=True)
class CheckpointNames:
    """How the checkpoint names the text model's modules: ``text_prefix`` replaces the model-side ``model.``."""

    text_prefix: str = TEXT_PREFIX

    def forms(self, name: str) -> tuple[str, ...]:
        """Module ``name`` (model side) as the checkpoint names it, then in the other Qwen3.5 form."""
        if not name.startswith(TEXT_PREFIX):
            return (name,)
        rest = name[len(TEXT_PREFIX):]
        other = VLM_TEXT_PREFIX if self.text_prefix == TEXT_PREFIX else TEXT_PREFIX
        return (self.text_prefix + rest, other + rest)

    def checkpoint_name(self, name: str) -> str:
        return self.forms(name)[0]


@functools.lru_cache(maxsize=1024)
def _pattern(expr: str) -> re.Pattern[str]:
    return re.compile(expr)


def check_entries(entries: list[str], field: str, *, regex: bool) -> None:
    """Refuse a list entry that is not a string, or (``regex``) an ``re:`` entry that does not compile."""
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"quantization_config.{field}: entries must be strings (got {entry!r})")
        if regex and entry.startswith("re:"):
            try:
                _pattern(entry[3:])
            except re.error as e:
                raise ValueError(f"quantization_config.{field}: {entry!r} is not a valid regex ({e})") from None


def matches(entry: str, names: tuple[str, ...], *, regex: bool, classes: bool) -> bool:
    """Whether list ``entry`` names a linear layer known by ``names`` (``regex``: ``re:`` entries are patterns;
    ``classes``: the class name ``Linear`` matches)."""
    if regex and entry.startswith("re:"):
        pattern = _pattern(entry[3:])
        return any(pattern.match(n) for n in names)
    if classes and entry == LINEAR_CLASS:
        return True
    return entry in names
