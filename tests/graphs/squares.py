"""counter -> square (2 replicas) -> collect: the engine's smallest real graph."""

from dataclasses import dataclass, field

from dataflow import Graph
from tests.graphs.toy import Collect, CollectConfig, Counter, CounterConfig, Square, SquareConfig


@dataclass(kw_only=True)
class Config:
    counter: CounterConfig = field(default_factory=CounterConfig)
    square: SquareConfig = field(default_factory=SquareConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    square_replicas: int = 2
    capacity: int = 4


config = Config()


def build(config: Config) -> Graph:
    g = Graph("squares")
    g.node("counter", Counter, config.counter, cpus=0.5)
    g.node("square", Square, config.square, cpus=0.5, replicas=config.square_replicas)
    g.node("collect", Collect, config.collect, cpus=0.5, ends_run=True)
    g.channel("counter.numbers", "square.numbers", capacity=config.capacity, name="numbers")
    g.channel("square.squares", "collect.squares", capacity=config.capacity, name="squares")
    return g
