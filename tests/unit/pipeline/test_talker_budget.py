"""The Talker's own per-step budget (`stages.talker.max_num_batched_tokens`) on the tiny checkpoint (CPU,
float32): the Talker's prompt goes in chunks of its budget while the Thinker keeps the engine's, and the codes
spoken are those of the Talker's prompt in one step."""

from __future__ import annotations

import pytest

from omnistage import LLM
from tests.unit.pipeline.test_talker_prefix import make_llm, run, speaking, user_rows, user_turn

BUDGET = 8  # the Talker's: a few rows of the user turns' ~20 a step


@pytest.fixture(scope="module")
def whole(tiny_checkpoint) -> LLM:
    return make_llm(tiny_checkpoint, prefix_caching=False)


@pytest.fixture(scope="module")
def chunked(tiny_checkpoint) -> LLM:
    return make_llm(tiny_checkpoint, prefix_caching=False, talker_max_num_batched_tokens=BUDGET)


def steps_of(llm: LLM, stage) -> list[int]:
    """The token counts of the steps `stage`'s scheduler hands out from now on."""
    counts: list[int] = []
    schedule = stage.scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        counts.append(out.num_tokens)
        return out

    stage.scheduler.schedule = counted
    return counts


def test_the_talkers_prompt_goes_in_chunks_of_its_own_budget_and_speaks_the_same(whole, chunked):
    messages = [user_turn(1), {"role": "assistant", "content": "Yes."}, user_turn(2)]
    assert user_rows(chunked, messages) > 2 * BUDGET
    expected = run(whole, [speaking(whole, "whole", messages, frames=6)])["whole"]
    talker_steps = steps_of(chunked, chunked.pipeline.speech_stages.talker_stage)
    thinker_steps = steps_of(chunked, chunked.pipeline.thinker)
    got = run(chunked, [speaking(chunked, "chunked", messages, frames=6)])["chunked"]
    assert max(talker_steps) == BUDGET and talker_steps.count(BUDGET) >= 2  # the prompt, cut
    assert max(thinker_steps) > BUDGET  # the Thinker's prompt in one step of the engine's 2,048
    assert got.audio_codes == expected.audio_codes
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
