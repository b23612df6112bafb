"""ckptkit.core.tree: state dicts to ``(path, leaf)`` lists and back, with torch DCP's own flattening as the oracle."""

from __future__ import annotations

import collections

import pytest
import torch

from _checks import assert_same_tree
from ckptkit.core.manifest import key_of
from ckptkit.core.tree import ListIndex, dcp_path, flatten, from_dcp_path, unflatten

T = torch.arange(3.0)


def is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


TREES = {
    "nested": {"model": {"w": T, "b": T + 1}, "step": 7, "name": "run"},
    "list-of-tensors": {"rng": [T, T * 2]},                        # descended: tensors inside
    "list-of-values": {"params": [1, 2, 3]},                       # a leaf: nothing to descend into
    "mixed-list": {"groups": [{"lr": 0.1, "w": T}, 3]},            # descended: a container inside
    "tuple": {"betas": (0.9, 0.95), "pair": (T, 1)},               # tuples are leaves, even with tensors
    "int-keys": {"state": {0: {"exp_avg": T}, 2: {"step": T}}},    # torch.optim's own keys
    "empty-containers": {"scaler": {}, "hooks": [], "w": T},       # leaves here; DCP drops the empty dict
    "ordered": collections.OrderedDict(b=T, a={"c": T}),
    "deep": {"a": [[T, {"b": [T]}]]},
}


@pytest.mark.parametrize("name", TREES)
def test_flatten_keys_and_paths_are_dcp_s(name):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    tree = TREES[name]
    ours = {key_of(path): (dcp_path(path), leaf) for path, leaf in flatten(tree, is_tensor)}
    flat, mappings = flatten_state_dict(tree)
    # DCP leaves out empty dicts (its loader trips over them); everything else matches key for key.
    kept = {k: v for k, v in ours.items() if not (isinstance(v[1], dict) and not v[1])}
    assert list(kept) == list(flat)
    for key, (path, leaf) in kept.items():
        assert path == mappings[key], key
        assert_same_tree(leaf, flat[key], key)


@pytest.mark.parametrize("name", TREES)
def test_unflatten_rebuilds_what_flatten_took_apart(name):
    tree = TREES[name]
    back = unflatten(list(flatten(tree, is_tensor)))
    assert_same_tree(back, tree)


@pytest.mark.parametrize("tree", [
    pytest.param(T, id="bare-tensor"),            # torch.save(tensor): one leaf at the empty path
    pytest.param([T, T], id="top-level-list"),    # torch.save([t0, t1])
    pytest.param({}, id="empty-dict"),            # torch.save({})
    pytest.param([], id="empty-list"),
])
def test_unflatten_keeps_a_top_level_that_is_not_a_dict(tree):
    items = list(flatten(tree, is_tensor))
    assert_same_tree(unflatten(items), tree)


def test_flatten_list_positions_are_list_indices_and_dict_int_keys_stay_ints():
    paths = [path for path, _ in flatten({"l": [T, T], "d": {1: T}}, is_tensor)]
    assert paths == [("l", 0), ("l", 1), ("d", 1)]
    assert [type(p[1]) for p in paths] == [ListIndex, ListIndex, int]


def test_dcp_path_round_trip():
    # DCP stringifies dict keys, so an int in its planner_data is always a list position.
    path = ("optim", "state", 0, "exp_avg", ListIndex(2))
    assert dcp_path(path) == ("optim", "state", "0", "exp_avg", 2)
    back = from_dcp_path(dcp_path(path))
    assert back == ("optim", "state", "0", "exp_avg", 2) and isinstance(back[-1], ListIndex)
