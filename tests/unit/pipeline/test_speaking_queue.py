"""The speaking requests' queue: first come first served, a turn only while fewer than max_speaking speak, an
abort anywhere in it, and the refused handed out once."""

from __future__ import annotations

from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.pipeline.speaking_queue import SpeakingQueue
from omnistage.request import GenerationRequest, SamplingParams, ValidRequest


def valid(request_id: str) -> ValidRequest:
    return ValidRequest(
        GenerationRequest(request_id, [1, 2, 3], SamplingParams(), prompt=f"p{request_id}"), 8
    )


def test_turns_come_in_arrival_order_and_only_below_the_bound():
    queue = SpeakingQueue(max_speaking=2)
    for i, request_id in enumerate(["a", "b", "c"]):
        queue.push(valid(request_id), arrival=float(i))
    assert len(queue) == 3
    assert queue.next_turn(num_speaking=2) is None and len(queue) == 3  # two speak already: none starts
    first = queue.next_turn(num_speaking=0)
    second = queue.next_turn(num_speaking=1)
    assert first is not None and second is not None
    assert (first.valid.request.request_id, first.arrival) == ("a", 0.0)
    assert (second.valid.request.request_id, second.arrival) == ("b", 1.0)
    assert not queue.has_turn(num_speaking=2) and queue.has_turn(num_speaking=1)
    last = queue.next_turn(num_speaking=1)
    assert last is not None and last.valid.request.request_id == "c"
    assert not queue and not queue.has_turn(num_speaking=0) and queue.next_turn(num_speaking=0) is None


def test_an_aborted_waiting_request_leaves_the_queue_with_its_final_output():
    queue = SpeakingQueue(max_speaking=1)
    for request_id in ["a", "b", "c"]:
        queue.push(valid(request_id), arrival=0.0)
    out = queue.abort("b")
    assert out is not None and out.finished and out.error is None
    assert (out.request_id, out.prompt, out.prompt_token_ids) == ("b", "pb", [1, 2, 3])
    assert out.outputs == [CompletionOutput(0, "", [], finish_reason="abort")]
    assert queue.abort("b") is None and queue.abort("unknown") is None
    turns = [queue.next_turn(num_speaking=0) for _ in range(2)]
    assert [t.valid.request.request_id for t in turns if t is not None] == ["a", "c"]


def test_the_refused_are_handed_out_once():
    queue = SpeakingQueue(max_speaking=1)
    refused = RequestOutput(
        "a", None, [1], [CompletionOutput(0, "", [], finish_reason="error")], finished=True
    )
    queue.refused.append(refused)
    assert not queue  # the refused do not wait
    assert queue.take_refused() == [refused] and queue.take_refused() == [] and not queue.refused
