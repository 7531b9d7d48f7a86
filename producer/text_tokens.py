"""Text from outside the model -> token ids, without special-token parsing.

A HF tokenizer turns the literal text of a special token ("<eos>", "<|im_end|>")
into that token, even with `add_special_tokens=False`: a user, tool or environment
whose text contains "<eos>" would end the model's turn, or forge a chat-template
role marker, in the very tokens the record trains on. Prompts, observations and
agents' messages are therefore encoded with `split_special_tokens=True`, which
tokenises such text as the ordinary characters it is.

A chat template is the exception: its own markers must become special tokens. A
rendered conversation is encoded piecewise (`encode_rendered`): the template's text
with parsing, and each message content that holds a special token's text without.
A content without any is left in place (parsing cannot misread it), so ordinary
conversations tokenise exactly as before.

`producer.engine.parse_special_tokens: true` turns the protection off: for sources
that write markers on purpose and are trusted (a prompt file pre-rendered with the
model's template).
"""
from __future__ import annotations

from collections.abc import Callable


class RewrittenSpecialText(ValueError):
    """A message content holding a special token's text was rewritten by the chat
    template, so it cannot be told apart from the template's own markers (the agent
    endpoint answers 400, an environment's episode ends with env_error)."""


def special_texts(tok) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (those `split_special_tokens` splits)."""
    return tuple(t.content for t in tok.added_tokens_decoder.values() if t.special)


def encode_text(tok, text: str, parse_special: bool = False) -> list[int]:
    """`text` -> ids, no BOS/EOS added; special-token texts are ordinary text unless `parse_special`."""
    # passed explicitly every time: the fast tokenizer keeps the last call's choice as its state
    return list(tok.encode(text, add_special_tokens=False, split_special_tokens=not parse_special))


def encode_rendered(tok, render: Callable[[list[str]], str], contents: list[str],
                    parse_special: bool = False) -> list[int]:
    """A chat-template rendering -> ids: the template's markers parsed as special tokens,
    the special-token texts inside `contents` (the messages' texts, in order) not.

    `render(texts)` renders the messages with `texts` as their contents. The template's
    own text is found by rendering a placeholder in place of each content that holds a
    special token's text (the same text may also be the template's marker, so it cannot
    simply be searched for). Raises RewrittenSpecialText when the template does not
    insert such a content verbatim."""
    rendered = render(contents)
    hostile = [i for i, c in enumerate(contents) if any(t in c for t in special_texts(tok))]
    if parse_special or not hostile:
        return encode_text(tok, rendered, parse_special=True)  # nothing to misread: exactly as before
    marks = {i: f"\x00rlstream-content-{i}\x00" for i in hostile}
    skeleton = render([marks.get(i, c) for i, c in enumerate(contents)])
    pieces, rest = [], skeleton
    for i in hostile:
        before, found, rest = rest.partition(marks[i])
        if not found:
            raise RewrittenSpecialText(f"messages[{i}].content holds a special token's text and the chat template "
                                       "does not insert it verbatim, so it cannot be kept as plain text")
        pieces += [(before, True), (contents[i], False)]
    pieces.append((rest, True))
    if "".join(text for text, _ in pieces) != rendered:
        raise RewrittenSpecialText("the chat template renders a message differently around a special token's "
                                   "text, so it cannot be kept as plain text")
    return [t for text, template in pieces for t in encode_text(tok, text, parse_special=template)]
