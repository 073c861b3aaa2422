"""One node that reads a JSONL file at setup: `--set reader.path=...` (tests/integration/test_runtime.py)."""

from dataclasses import dataclass, field

from dataflow import Graph
from tests.graphs.probes import JsonlReader, ReaderConfig


@dataclass(kw_only=True)
class Config:
    reader: ReaderConfig = field(default_factory=ReaderConfig)


config = Config()


def build(config: Config) -> Graph:
    g = Graph("jsonl_reader")
    g.node("reader", JsonlReader, config.reader, cpus=0.25)
    return g
