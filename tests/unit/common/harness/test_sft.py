"""The SFT warm start (ops/harness/sft.py): examples and batches."""
from __future__ import annotations

from rlstream.common.tasks.arithmetic import Problem


def test_sft_batches_mask_the_prompt():
    from rlstream.harness.sft import _collate

    x, mask, labels = _collate([([5, 6, 7, 1], [False, False, True, True]),
                                ([5, 6, 1], [False, False, True])], pad_id=0)
    assert x.tolist() == [[5, 6, 7, 1], [5, 6, 1, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[-100, -100, 7, 1], [-100, -100, 1, -100]]


def test_sft_examples_are_prompt_answer_eos_of_the_tasks_problems():
    from rlstream.harness.sft import _encode_examples

    class CharTokenizer:  # one id per character, eos 1
        eos_token_id = 1

        def encode(self, text, add_special_tokens=False, split_special_tokens=False):
            return [ord(c) for c in text]

    got = _encode_examples(CharTokenizer(), [Problem("1+2=", "3")])
    assert got == [([ord(c) for c in "1+2="] + [ord("3"), 1], [False] * 4 + [True, True])]
