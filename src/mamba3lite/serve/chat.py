"""Chat messages to a prompt: the run's chat template where it has one, else a documented plain one.

The run's template is the `chat_template` of a `tokenizer_config.json` in the run directory (or beside
the run's tokenizer.json), rendered with Jinja2 in a sandbox as Hugging Face renders it (`messages`,
`add_generation_prompt=True`, `bos_token`, `eos_token`). Without one, the plain template is

    System: <content>
    User: <content>
    Assistant: <content>
    ...
    Assistant:

(one line per message, the role capitalised, then "Assistant:" for the reply), and the reply also stops
at "\\nUser:" so that the model does not write the user's next turn.
"""

from __future__ import annotations

from pathlib import Path

from mamba3lite import intake
from mamba3lite.errors import ConfigError

PLAIN_STOPS = ("\nUser:",)


def find_chat_template(run_dir: Path, tokenizer_name: str) -> str | None:
    """The `chat_template` string of the run's tokenizer_config.json, or None when there is none."""
    candidates = [Path(run_dir) / "tokenizer_config.json"]
    if tokenizer_name != "gpt2":
        candidates.append(Path(tokenizer_name).parent / "tokenizer_config.json")
    for path in candidates:
        if path.is_file():
            cfg = intake.read_json(path, intake.TOKENIZER)
            template = cfg.get("chat_template")
            if isinstance(template, str) and template.strip():
                return template
            if template is not None and not isinstance(template, str):
                raise ConfigError(f"{path}: chat_template must be a string (a Jinja2 template)")
    return None


class ChatRenderer:
    """`render(messages) -> (prompt text, extra stop strings)`, with the template chosen once."""

    def __init__(self, template: str | None, eos_text: str) -> None:
        self.eos_text = eos_text
        self._template = None
        if template is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as e:
                raise ConfigError("the run's chat template needs Jinja2; fix: pip install jinja2") from e
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(template)

    @property
    def kind(self) -> str:
        return "plain" if self._template is None else "run"

    def __call__(self, messages: list[dict]) -> tuple[str, tuple[str, ...]]:
        if self._template is None:
            lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
            return "\n".join([*lines, "Assistant:"]), PLAIN_STOPS
        from mamba3lite.serve.protocol import APIError

        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=True, bos_token="", eos_token=self.eos_text
            )
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise APIError(
                400, f"the chat template cannot render these messages: {e}", param="messages"
            ) from None
        return text, ()
