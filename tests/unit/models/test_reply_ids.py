"""An assistant message given with the ids the model sampled for it (as a realtime session keeps its replies):
the prompt holds those ids where the text is, not the text encoded again, which may split it otherwise and
would end the prefix cache's hits there."""

import pytest

from omnistage.models.qwen3_omni.processor import Processor


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    return Processor(tiny_checkpoint)


def chat(reply: dict) -> list[dict]:
    return [{"role": "user", "content": "Hi."}, reply, {"role": "user", "content": "And then?"}]


def split(processor: Processor, text: str, at: int) -> list[int]:
    """`text` as two pieces' ids: a spelling the tokenizer would not choose for the whole."""
    pieces = processor.tokenizer.encode_batch([text[:at], text[at:]], add_special_tokens=False)
    ids = pieces[0].ids + pieces[1].ids
    assert ids != processor.tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def test_the_sampled_ids_stand_for_the_reply(processor):
    text = "Hello there, nothing is wrong."
    sampled = split(processor, text, 3)
    canonical = processor.tokenizer.encode(text, add_special_tokens=False).ids
    plain_prompt, plain = processor.encode_chat(chat({"role": "assistant", "content": text}))
    prompt, ids = processor.encode_chat(chat({"role": "assistant", "content": text, "token_ids": sampled}))
    assert prompt == plain_prompt  # the same rendered text
    at = next(i for i in range(len(ids)) if ids[i : i + len(sampled)] == sampled)
    # the template's ids around the reply are the text's, as encoded whole
    assert ids[:at] + canonical + ids[at + len(sampled) :] == plain


def test_a_reply_ending_with_its_end_token_and_ids_that_do_not_spell_it(processor):
    text = "Hello there."
    sampled = split(processor, text, 2)
    end = processor.tokenizer.token_to_id("<|im_end|>")
    with_end = processor.encode_chat(
        chat({"role": "assistant", "content": text, "token_ids": [*sampled, end]})
    )
    assert with_end == processor.encode_chat(
        chat({"role": "assistant", "content": text, "token_ids": sampled})
    )
    other = processor.tokenizer.encode("Goodbye.", add_special_tokens=False).ids
    plain = processor.encode_chat(chat({"role": "assistant", "content": text}))
    assert processor.encode_chat(chat({"role": "assistant", "content": text, "token_ids": other})) == plain
    user = processor.encode_chat([{"role": "user", "content": text, "token_ids": sampled}])
    assert user == processor.encode_chat([{"role": "user", "content": text}])  # only a reply's ids count
