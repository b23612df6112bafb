"""What a conversion writes beside the optimizer's moments so that a trainer's own load takes it: the param
groups' ``initial_lr``, torchtitan's ``train_state`` and ``lr_scheduler``, DeepSpeed's per-parameter step as a
0-d tensor, and the step ``ckptkit.load`` returns. Read back with torch's own ``dcp.load`` and ``torch.load``.
The resumes these make possible are the cells of ``tests/frameworks/test_resume_matrix.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit

transformers = pytest.importorskip("transformers")


def _llama(tmp_path: Path) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    config.save_pretrained(tmp_path / "assets")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _saved(tmp_path: Path, group: dict, step: float | torch.Tensor = 2.0, **rest) -> tuple[Path, list[str]]:
    """A ``torch.save`` of the model and an Adam-shaped optimizer state in one param group ``group``."""
    model = _llama(tmp_path)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    state = {k: {"exp_avg": torch.ones_like(v), "exp_avg_sq": torch.ones_like(v), "step": step} for k, v in sd.items()}
    torch.save({"model": sd, "optim": {"state": state, "param_groups": [{**group, "params": list(sd)}]}, **rest},
               tmp_path / "src.pt")
    return tmp_path / "src.pt", list(sd)


def _objects(path: Path, keys: list[str]) -> dict[str, object]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, object] = dict.fromkeys(keys)
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


@pytest.mark.parametrize(("group", "rest", "initial_lr"), [
    ({"lr": 0.005}, {}, 0.005),                                               # no scheduler: the rate itself
    ({"lr": 0.005}, {"scheduler": {"base_lrs": [0.01], "last_epoch": 2}}, 0.01),  # a torch scheduler's base rate
    ({"lr": 0.005, "max_lr": 0.02}, {}, 0.02),                                # megatron-core's peak rate
    ({"lr": 0.005, "initial_lr": 0.03}, {}, 0.03),                            # as saved
], ids=["lr", "base_lrs", "max_lr", "saved"])
def test_convert_into_torchtitan_names_gives_every_param_group_its_initial_lr(tmp_path, group, rest, initial_lr):
    src, names = _saved(tmp_path, group, **rest)
    report = ckptkit.convert(src, tmp_path / "titan", to="sharded", preset="torchtitan-llama",
                             hf_assets=tmp_path / "assets")
    keys = [f"optimizer.param_groups.{k}.{f}" for k in ("norm.weight", "tok_embeddings.weight")
            for f in ("lr", "initial_lr")]
    found = _objects(tmp_path / "titan", [*keys, "train_state.step", "train_state.ntokens_seen",
                                          "lr_scheduler.last_epoch"])
    assert [found[k] for k in keys] == [0.005, initial_lr] * 2
    assert (found["train_state.step"], found["train_state.ntokens_seen"], found["lr_scheduler.last_epoch"]) == (2, 0, 2)
    assert any(n.startswith("train_state written for torchtitan's Trainer: step 2 (from optim.state.<parameter>.step)")
               for n in report.notes), report.notes


def test_convert_into_torchtitan_names_of_a_source_without_a_step_says_what_to_exclude(tmp_path):
    src, _ = _saved(tmp_path, {"lr": 0.005}, step=torch.tensor(float("nan")))
    report = ckptkit.convert(src, tmp_path / "titan", to="sharded", preset="torchtitan-llama",
                             hf_assets=tmp_path / "assets")
    assert ("no train_state or lr_scheduler written: the source records no step; load it in torchtitan with "
            "exclude_from_loading=['train_state', 'lr_scheduler', 'dataloader']") in report.notes


def test_convert_to_deepspeed_universal_writes_a_step_kept_as_a_number_as_a_0d_tensor(tmp_path):
    # megatron-core keeps the step in its param groups: split per parameter, it is a number. torch's Adam in
    # DeepSpeed's engine wants a tensor ("state_steps argument must contain a list of singleton tensors").
    src, names = _saved(tmp_path, {"lr": 0.005}, step=3.0)
    ckptkit.convert(src, tmp_path / "uc", to="deepspeed-universal")
    step = torch.load(tmp_path / "uc" / "global_step3" / "zero" / names[0] / "step.pt", weights_only=True)
    assert isinstance(step, torch.Tensor) and step.shape == () and step.dtype == torch.float32 and step.item() == 3


def test_load_returns_the_optimizers_step_of_a_checkpoint_that_records_no_other(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _llama(tmp_path)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.arange(8)[None]).logits.sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ckptkit.reshard(tmp_path / "dcp", tmp_path / "r3", world_size=3)
    for path in (tmp_path / "dcp", tmp_path / "r3"):
        fresh = _llama(tmp_path)
        assert ckptkit.load(path, fresh, optimizer=torch.optim.AdamW(fresh.parameters())).step == 2


def test_megatron_groups_are_made_from_each_parameters_hyperparameters_and_refuse_by_name():
    from ckptkit.errors import FormatError
    from ckptkit.formats.megatron.groups import megatron_groups

    adam = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}
    names = ["embedding.word_embeddings.weight", "decoder.layers.input_layernorm.weight", "output_layer.weight"]
    plain = {"decoder.layers.input_layernorm.weight"}.__contains__
    per_param = {n: {**adam, "weight_decay": 0.0 if plain(n) else 0.1} for n in names}  # torchtitan keeps them so
    assert megatron_groups(per_param, names, plain) == [
        {**adam, "weight_decay": 0.1, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
         "is_decoupled_lr": False},
        {**adam, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
         "is_decoupled_lr": False}]
    decayed = {**per_param, names[1]: {**adam, "weight_decay": 0.1}}
    with pytest.raises(FormatError, match=r"'decoder\.layers\.input_layernorm\.weight' \(a 1-D parameter or bias\) "
                                          r"trained with weight_decay=0\.1"):
        megatron_groups(decayed, names, plain)
    with pytest.raises(FormatError, match=r"no param group holds 'output_layer\.weight'"):
        megatron_groups({n: f for n, f in per_param.items() if n != names[2]}, names, plain)
