"""``ckptkit.load`` of checkpoints ckptkit did not write: the model part by the rule export-hf uses, the
optimizer when one is there and fits. One process, plain modules; FSDP ranks are in test_save_load.py and
the frameworks' own checkpoints in tests/frameworks/."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptkit
from _checks import assert_same_tree
from ckptkit.errors import CheckpointError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 9, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.embed(x))))


def _trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        net(torch.arange(9)).sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _fresh() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(1)
    net = Net()
    return net, torch.optim.AdamW(net.parameters(), lr=0.5)


def _assert_loaded(net: Net, opt, ref: Net, ref_opt, with_optimizer: bool = True) -> None:
    msd, osd = get_state_dict(net, opt)
    ref_msd, ref_osd = get_state_dict(ref, ref_opt)
    assert_same_tree(msd, ref_msd)
    if with_optimizer:
        assert_same_tree(osd["state"], ref_osd["state"])
        # torch's set_state_dict(full_state_dict=True) hands AdamW its betas as a list
        as_lists = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in osd["param_groups"]]
        assert as_lists == [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                            for g in ref_osd["param_groups"]]


def test_load_plain_state_dict_file(tmp_path):
    ref, _ = _trained()
    torch.save(ref.state_dict(), tmp_path / "model.pt")
    net, opt = _fresh()
    result = ckptkit.load(tmp_path / "model.pt", net, optimizer=opt, load_optimizer=False)
    assert not result.optimizer_loaded and result.step is None
    assert_same_tree(net.state_dict(), ref.state_dict())


def test_load_with_an_optimizer_refuses_a_checkpoint_without_optimizer_state(tmp_path):
    ref, _ = _trained()
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "hf" / "model.safetensors")
    net, opt = _fresh()
    with pytest.raises(CheckpointError, match=r"hf: holds no optimizer state for the model \(4 model tensors, "
                                              r"nothing else\); pass load_optimizer=False \(or no optimizer\) to "
                                              r"load the weights alone"):
        ckptkit.load(tmp_path / "hf", net, optimizer=opt)
    assert not ckptkit.load(tmp_path / "hf", net, optimizer=opt, strict=False).optimizer_loaded
    assert_same_tree(net.state_dict(), ref.state_dict())
    net = _fresh()[0]
    assert not ckptkit.load(tmp_path / "hf", net).optimizer_loaded


@pytest.mark.parametrize("layout", [
    "accelerate",  # save_state's pytorch_model_fsdp_0/: dcp.save({"model": model_sd})
    "fabric",      # Lightning Fabric sharded: one DCP of {"model": ..., "optimizer": ...} plus meta.pt
    "lightning",   # Lightning Trainer sharded: LightningModule names (self.net) under model, optimizer_0
    "torchtitan",  # model keys at the top level, flattened optimizer state beside them
    "full",        # a torch.save of {"model": ..., "optimizer": ...} (Fabric's full checkpoint)
])
def test_load_other_frameworks_layouts(tmp_path, layout):
    ref, ref_opt = _trained()
    msd, osd = get_state_dict(ref, ref_opt)
    with_optimizer = layout != "accelerate"
    if layout == "accelerate":
        dcp.save({"model": msd}, checkpoint_id=str(tmp_path / "ckpt"))
    elif layout == "fabric":
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ckpt"))
        torch.save({"step": 2}, tmp_path / "ckpt" / "meta.pt")
    elif layout == "lightning":
        named = {f"net.{k}": v for k, v in msd.items()}
        optim = {"state": {f"net.{k}": v for k, v in osd["state"].items()},
                 "param_groups": [{**g, "params": [f"net.{p}" for p in g["params"]]} for g in osd["param_groups"]]}
        dcp.save({"model": named, "optimizer_0": optim}, checkpoint_id=str(tmp_path / "ckpt"))
        torch.save({"global_step": 2, "pytorch-lightning_version": "2.6.6"}, tmp_path / "ckpt" / "meta.pt")
    elif layout == "torchtitan":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        flat = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({**msd, "optimizer": flat, "lr_scheduler": {"last_epoch": 2}, "train_state": {"step": 2}},
                 checkpoint_id=str(tmp_path / "ckpt"))
    else:
        torch.save({"model": msd, "optimizer": osd, "step": 2}, tmp_path / "ckpt")
    net, opt = _fresh()
    assert ckptkit.load(tmp_path / "ckpt", net, optimizer=opt, strict=with_optimizer).optimizer_loaded == \
        with_optimizer
    _assert_loaded(net, opt, ref, ref_opt, with_optimizer)


def test_load_strict_lists_keys_both_ways(tmp_path):
    ref, _ = _trained()
    sd = ref.state_dict()
    sd["extra.weight"] = torch.ones(2)
    del sd["proj.bias"]
    torch.save(sd, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"checkpoint lacks 1 keys the model needs: proj\.bias; it holds 1 "
                                              r"model keys the model does not have: extra\.weight"):
        ckptkit.load(tmp_path / "model.pt", _fresh()[0])
    net = _fresh()[0]
    ckptkit.load(tmp_path / "model.pt", net, strict=False)
    assert torch.equal(net.proj.weight, ref.proj.weight)


def test_load_optimizer_state_that_does_not_fit(tmp_path):
    # Lightning Trainer's full checkpoint keys optimizer state by parameter index, not by name.
    ref, ref_opt = _trained()
    torch.save({"state_dict": ref.state_dict(), "optimizer_states": [ref_opt.state_dict()],
                "pytorch-lightning_version": "2.6.6"}, tmp_path / "last.ckpt")
    net, opt = _fresh()
    with pytest.raises(CheckpointError, match=r"the optimizer state in 'optimizer_states\.0' does not fit the "
                                              r"optimizer: it lacks 12 entries: optimizer_states\.0\.state\.embed\."
                                              r"weight\.step, "):
        ckptkit.load(tmp_path / "last.ckpt", net, optimizer=opt)
    net, opt = _fresh()
    assert not ckptkit.load(tmp_path / "last.ckpt", net, optimizer=opt, strict=False).optimizer_loaded
    assert_same_tree(net.state_dict(), ref.state_dict())


def test_load_an_optimizer_only_checkpoint_says_what_it_is(tmp_path):
    ref, ref_opt = _trained()
    torch.save(ref_opt.state_dict(), tmp_path / "optimizer.bin")
    with pytest.raises(CheckpointError, match=r"holds optimizer state only"):
        ckptkit.load(tmp_path / "optimizer.bin", _fresh()[0])
