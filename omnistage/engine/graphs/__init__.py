"""CUDA graphs: one `GraphSet` per stage's step over its static buffers (`base.py`), and each stage's set."""

from omnistage.engine.graphs.base import DecodeGraphRunner, GraphSet, PrefillGraphRunner
from omnistage.engine.graphs.code2wav import Code2WavGraphs
from omnistage.engine.graphs.encoders import AudioGraphs, VisionGraphs
from omnistage.engine.graphs.frames import FrameGraphRunner

__all__ = [
    "AudioGraphs",
    "Code2WavGraphs",
    "DecodeGraphRunner",
    "FrameGraphRunner",
    "GraphSet",
    "PrefillGraphRunner",
    "VisionGraphs",
]
