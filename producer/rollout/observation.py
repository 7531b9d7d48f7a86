"""Environment text as token ids, once: the encoding of an observation (or of the
messages that follow a model turn) appended to a trajectory with loss mask 0.
Used by the episode runner (producer/rollout/episodes.py) and the agent driver
(producer/rollout/agents/driver.py); a special token's text in it stays text
unless producer.engine.parse_special_tokens (producer/text_tokens.py)."""
from __future__ import annotations

from rlstream.common.errors import ConfigError
from rlstream.producer.text_tokens import encode_rendered, encode_text


class ObservationEncoder:
    """Environment text -> token ids, once. Without a chat template: the plain
    tokenizer. With one: the text as a message of `role`, rendered as the
    template renders it after an assistant turn, minus the model's own closing
    token (it is already in the response, as sampled). Either way a special
    token's text in the messages is ordinary text unless `parse_special`
    (producer.engine.parse_special_tokens)."""

    def __init__(self, tokenizer, role: str = "tool", parse_special: bool = False):
        self.tok, self.role, self.parse_special = tokenizer, role, parse_special
        self.template = getattr(tokenizer, "chat_template", None) is not None

    def __call__(self, text: str, last_model_token: int | None = None) -> list[int]:
        return self.messages([{"role": self.role, "content": text}], last_model_token)

    def messages(self, messages: list[dict], last_model_token: int | None = None) -> list[int]:
        """Messages that follow a model turn (tool, user or system), as token ids; without
        a chat template their contents concatenated (producer/rollout/agents/driver.py uses this too)."""
        if not self.template:
            return encode_text(self.tok, "".join(m["content"] for m in messages), self.parse_special)
        def render(texts: list[str]) -> str:
            return self._delta([{**m, "content": t} for m, t in zip(messages, texts)], last_model_token)

        return encode_rendered(self.tok, render, [m["content"] for m in messages], self.parse_special)

    def _delta(self, messages: list[dict], last_model_token: int | None) -> str:
        marker = "\x00assistant\x00"
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
        head = self.tok.apply_chat_template(base, tokenize=False)
        full = self.tok.apply_chat_template(base + list(messages), tokenize=False, add_generation_prompt=True)
        if not full.startswith(head) or marker not in head:
            raise ConfigError("the chat template does not render a conversation as a prefix of its "
                              "continuation; multi-turn needs one that does", key="producer.episodes")
        closing = head[head.index(marker) + len(marker):]  # what follows an assistant turn
        if last_model_token is not None:
            stop = self.tok.decode([last_model_token], skip_special_tokens=False)
            if stop and closing.startswith(stop):
                closing = closing[len(stop):]  # sampled already
        return closing + full[len(head):]
