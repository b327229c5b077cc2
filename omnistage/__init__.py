"""omnistage: an inference server for thinker-talker omni models."""
