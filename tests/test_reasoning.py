"""The reasoning parser: where a reply's thought ends, however its text is cut into chunks."""
import pytest

from lmdeploy_lite.reasoning import ReasoningParser, reply_parser

THINKING = '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n'
NOT_THINKING = '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n'
HISTORY = NOT_THINKING + 'old answer<|im_end|>\n<|im_start|>assistant\n<think>\n'
CALL = '<tool_call>\n<function=f>\n</function>\n</tool_call>'


def split(text: str, prompt: str, step: int) -> tuple[str, str]:
    parser, reasoning, content = reply_parser(lambda ids: prompt, [0]), '', ''
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or ['']
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize('step', [1, 2, 3, 7, 1000])
@pytest.mark.parametrize('prompt, reply, want', [
    (THINKING, 'let me see\n</think>\n\nThe answer.', ('let me see\n', 'The answer.')),
    # the template closed an empty block: a reply with no tags is all answer (vllm#53284)
    (NOT_THINKING, 'The answer, no thought.', ('', 'The answer, no thought.')),
    (NOT_THINKING, '<think> is a tag.</think>', ('', '<think> is a tag.</think>')),   # as vLLM
    (HISTORY, 'again\n</think>\n\nNew.', ('again\n', 'New.')),
    # a template that adds nothing: the reply opens its own block
    ('<|im_start|>assistant\n', '<think>\nhmm\n</think>\n\nYes.', ('\nhmm\n', 'Yes.')),
    ('<|im_start|>assistant\n', '<thin and more', ('', '<thin and more')),
    # cut inside the thought (finish_reason 'length'): reasoning only
    (THINKING, 'still thinking </thi', ('still thinking </thi', '')),
    (THINKING, '</think>', ('', '')),
    (THINKING, 'a < b </ c\n</think>\n\n<think> is text now', ('a < b </ c\n',
                                                               '<think> is text now')),
    # a call the thought did not close ends it (as vLLM, vllm#35687); a later </think> is text
    (THINKING, 'call it\n' + CALL + ' </think>', ('call it\n', CALL + ' </think>')),
    ('<|im_start|>assistant\n', '<think>x <tool_ ' + CALL, ('x <tool_ ', CALL)),
    (THINKING, 'x</think>\n' + CALL, ('x', CALL)),
    # the prompt opened the block and the reply opens it again (as vLLM: the tag is dropped)
    (THINKING, '\n<think>\nhm</think>\n\nYes.', ('\nhm', 'Yes.')),
    (THINKING, '<thinking aloud</think>Yes.', ('<thinking aloud', 'Yes.')),
])
def test_split_is_the_same_for_every_chunking(prompt, reply, want, step):
    assert split(reply, prompt, step) == want


def test_text_that_may_open_or_close_a_tag_is_held_until_it_cannot():
    parser = ReasoningParser(in_thought=True)
    assert parser.feed('x </th') == ('x ', '')
    assert parser.feed('ink>') == ('', '')
    assert parser.feed('\n') == ('', '')
    assert parser.feed('\nok') == ('', 'ok')
    starting = ReasoningParser(in_thought=False)
    assert starting.feed('  <th') == ('', '')
    assert starting.feed('e answer') == ('', '  <the answer')
