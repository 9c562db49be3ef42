"""Chat templates: a run's own (a transformers Jinja template, RUN/chat_template.jinja) or the plain one.

serve.py renders a chat request's messages with them, and data.py --format preference renders
conversational pairs the same way, so that a model tuned on conversations is served as it was trained.
"""
from __future__ import annotations

import pathlib

CHAT_TEMPLATE = "chat_template.jinja"  # a run's chat template (a model imported from transformers brings its own)
PLAIN_STOP = "\nUser:"  # where a reply in the plain chat template ends: the next turn


def plain_template(messages: list[dict]) -> str:
    """The chat template of a run without one of its own: a system message as it is, then each turn as
    `User: ...` or `Assistant: ...` on its own line, ending with `Assistant:` for the reply (which ends at
    the end-of-text token or at the next `\\nUser:`)."""
    lines = []
    for m in messages:
        if m["role"] in ("system", "developer"):
            lines.append(m["content"] + "\n")
        else:
            lines.append(("User: " if m["role"] == "user" else "Assistant: ") + m["content"])
    return "\n".join(lines) + "\nAssistant:"


def compile_template(source: str, refuse):
    """A transformers chat template (Jinja) made ready to render, in Jinja's sandbox as transformers does;
    `refuse(message)` is what the template's raise_exception calls (it raises the caller's error)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = refuse
    return env.from_string(source)


def template_of(directory) -> str | None:
    """The chat template beside a tokenizer (a run or data directory's chat_template.jinja), or None."""
    path = pathlib.Path(directory) / CHAT_TEMPLATE if directory is not None else None
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None
