"""Voices by name: the checkpoint's speakers, and other names for them (OpenAI's voices by default).

Clients built for OpenAI send only OpenAI's voice names (Pipecat's default is `alloy`, LiveKit's `ash`); a
Qwen3-Omni checkpoint speaks as its released speakers (chelsie, ethan, aiden). Each of OpenAI's names is an
alias of the speaker nearest its character, female or male (`DEFAULT_ALIASES`); the engine's `voice_aliases`
adds to or overrides the table. A speaker's own name always means that speaker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omnistage.errors import ConfigError
from omnistage.server.errors import InvalidField

# OpenAI's voices (the `openai` package's SpeechCreateParams.voice) onto Qwen3-Omni's released speakers by
# their character: the female voices are chelsie; the male ones ethan (the released default speaker),
# the two story-telling ones (ballad, fable) aiden; alloy, which OpenAI calls neutral, the default, ethan.
DEFAULT_ALIASES: dict[str, str] = {
    "alloy": "ethan",
    "ash": "ethan",
    "ballad": "aiden",
    "cedar": "ethan",
    "coral": "chelsie",
    "echo": "ethan",
    "fable": "aiden",
    "marin": "chelsie",
    "nova": "chelsie",
    "onyx": "ethan",
    "sage": "chelsie",
    "shimmer": "chelsie",
    "verse": "ethan",
}


@dataclass(frozen=True)
class Voices:
    """The speakers a checkpoint speaks as (lower case; none where it cannot speak) and the aliases of
    them; `speaker(name)` is the speaker a request's voice names."""

    speakers: tuple[str, ...]
    aliases: Mapping[str, str]

    @classmethod
    def of(cls, speakers: tuple[str, ...], configured: Mapping[str, str] | None = None) -> Voices:
        """The checkpoint's `speakers` with the default aliases of those it has, and the `configured` ones
        (the engine's `voice_aliases`) on top. Raises ConfigError for a configured alias that names no
        speaker of the checkpoint, or that is a speaker's own name."""
        if not speakers:
            return cls((), {})
        aliases = {name: speaker for name, speaker in DEFAULT_ALIASES.items() if speaker in speakers}
        for name, speaker in (configured or {}).items():
            name, speaker = name.strip().lower(), speaker.strip().lower()
            if speaker not in speakers:
                raise ConfigError(
                    f"voice_aliases: {name}={speaker}: {speaker!r} is not a speaker of this checkpoint; "
                    f"it speaks as {', '.join(speakers)}"
                )
            if name in speakers:
                raise ConfigError(f"voice_aliases: {name}={speaker}: {name!r} is a speaker's own name")
            aliases[name] = speaker
        return cls(speakers, dict(sorted(aliases.items())))

    def speaker(self, name: str, param: str) -> str:
        """The speaker the voice `name` means; an unknown one is a 400 naming `param`, the client's field."""
        key = name.strip().lower()
        if key in self.speakers:
            return key
        if key in self.aliases:
            return self.aliases[key]
        also = f" and the aliases {', '.join(self.aliases)}" if self.aliases else ""
        raise InvalidField(
            param, f"unknown voice {name!r}; this model speaks with {', '.join(self.speakers)}{also}"
        )

    def listing(self) -> dict[str, object]:
        """`GET /v1/audio/voices`' body."""
        return {"voices": list(self.speakers), "aliases": dict(self.aliases)}
