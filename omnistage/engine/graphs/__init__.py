"""CUDA graphs: one `GraphSet` per stage's step over its static buffers (`base.py`), and each stage's set."""

from omnistage.engine.graphs.base import GraphSet
from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.engine.graphs.decode import DecodeGraphs
from omnistage.engine.graphs.encoders import AudioGraphs, VisionGraphs
from omnistage.engine.graphs.frames import FrameGraphs
from omnistage.engine.graphs.prefill import PrefillGraphs

__all__ = [
    "AudioGraphs",
    "Code2WavGraphs",
    "DecodeGraphs",
    "FrameGraphs",
    "GraphSet",
    "PrefillGraphs",
    "VisionGraphs",
]
