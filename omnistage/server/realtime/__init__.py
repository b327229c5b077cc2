"""OpenAI's Realtime API over WebSocket (`/v1/realtime`): route.py takes the connection, session.py runs it,
turns.py streams its responses and transcription.py a transcription session's turns; protocol.py holds the
client events, settings.py the session's settings, conversation.py its items and codecs.py its audio formats."""
