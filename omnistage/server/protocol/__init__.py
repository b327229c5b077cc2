"""The OpenAI HTTP protocol's requests as pydantic models, checked field by field (server/responses.py: the
replies): `base` what they share, `chat`, `completions` and `speech` each endpoint's body.

Requests are strict: an unknown field is a 400 naming it, and so is a value of the wrong JSON type
(`"stream": "yes"`, `"temperature": true`; an integer is still a number), an integer beyond int64 or a
number that is not finite. Every field of OpenAI's current request schemas is accepted: honoured, ignored
where ignoring it changes nothing the client gets (see the README), or refused with a 400 naming the field
where ignoring it would (`n` > 1, logprobs, tools, JSON response formats). Sampling extras that OpenAI
lacks (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, ...) carry vLLM's names, so clients pass
them through `extra_body` unchanged; the Talker's take the same names beside `max_frames`.
"""
