"""The node kinds, one file each (docs/architecture.md): a graph file imports them from here,

    from nodes import Generator, Learner, PromptSource, Reference

or from their own files (nodes/generator.py, ...). A name is imported from its file when first
asked for (PEP 562), so an actor that hosts one kind never imports the others' modules. The model
kinds' files are declarations without torch; their code is in nodes/impl/ (Node.implementation),
which only the node's own process imports, so the driver imports no torch before Ray starts.
"""

import importlib

_FILES = {
    "prompts": ("PromptSource", "PromptConfig", "DROPPED_EDGE"),
    "generator": ("Generator", "GeneratorConfig"),
    "reward": ("Reward", "RewardWithValidation", "RewardConfig"),
    "reward_model": ("RewardModel", "RewardModelConfig"),
    "group_filter": ("GroupFilter", "GroupFilterConfig"),
    "reference": ("Reference", "ReferenceConfig"),
    "critic": ("Critic", "CriticConfig"),
    "learner": ("Learner", "LearnerConfig"),
    "evaluator": ("Evaluator", "ValidationConfig", "VALIDATED"),
}
_FILE_OF = {name: file for file, names in _FILES.items() for name in names}
__all__ = sorted(_FILE_OF)


def __getattr__(name: str):
    if name not in _FILE_OF:
        raise AttributeError(f"module 'nodes' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nodes.{_FILE_OF[name]}"), name)


def __dir__() -> list[str]:
    return __all__
