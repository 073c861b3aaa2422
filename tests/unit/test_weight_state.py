"""dataflow/weights/state.py's unique_state / with_aliases: an object-store push sends a tied tensor
once and the generator gets every name back, pointing at the one tensor."""

from __future__ import annotations

import torch

from dataflow.weights.state import unique_state, with_aliases


def test_a_tied_tensor_is_kept_once_and_comes_back_under_every_name():
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight                       # tied, as a Llama with tie_word_embeddings
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "norm": torch.nn.LayerNorm(4)})
    state = model.state_dict()
    assert set(state) == {"embed.weight", "head.weight", "norm.weight", "norm.bias"}

    kept, aliases = unique_state(state)
    assert set(kept) == {"embed.weight", "norm.weight", "norm.bias"} and aliases == {"head.weight": "embed.weight"}
    back = with_aliases({k: v.clone() for k, v in kept.items()}, aliases)
    assert set(back) == set(state) and back["head.weight"] is back["embed.weight"]

    other = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False),
                                 "norm": torch.nn.LayerNorm(4)})
    other.head.weight = other.embed.weight
    other.load_state_dict(back)                      # strict: every name is there
    assert torch.equal(other.head.weight, embed.weight)


def test_equal_values_and_views_of_one_storage_are_not_aliases():
    """Only the same tensor (storage, offset, shape, strides) is an alias: equal copies and
    different views of one buffer travel separately; a state without ties comes back unchanged."""
    base = torch.arange(12.0)
    state = {"a": base, "b": base.clone(), "c": base.view(3, 4), "d": base[4:], "e": torch.empty(0),
             "f": torch.empty(0)}
    kept, aliases = unique_state(state)
    assert aliases == {} and list(kept) == list(state)
    assert with_aliases(kept, {}) is kept


def test_tensors_without_storage_are_aliases_only_of_themselves():
    """A DTensor's data_ptr() is 0 (a learner on dp x tp ranks), as a meta tensor's: two of one shape
    are two tensors; the same parameter under two names (state_dict(keep_vars=True)) is one."""
    q, o = (torch.nn.Parameter(torch.empty(4, 4, device="meta")) for _ in range(2))
    assert q.data_ptr() == o.data_ptr() == 0
    kept, aliases = unique_state({"q": q, "o": o, "head": q})
    assert list(kept) == ["q", "o"] and aliases == {"head": "q"}
