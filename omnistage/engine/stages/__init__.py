"""A pipeline's stages, each one role on one device, all of one protocol (`base.py`)."""
