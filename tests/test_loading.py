"""`loading.from_pretrained`: the package's model without the random initialisation its checkpoint
replaces (`skip_init`), tensor for tensor the package's own; a checkpoint that lacks a tensor is
refused; `verify_weights` compares every tensor with the checkpoint's, bit for bit."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

from vox_ws.engines.voxcpm.loading import from_pretrained, import_voxcpm, verify_weights
from vox_ws.engines.voxcpm.skip_init import NotInCheckpoint, built_for_checkpoint
from vox_ws.testing.tiny_voxcpm import build


def package_load(path, **options):
    return import_voxcpm().VoxCPM.from_pretrained(str(path), load_denoiser=False, optimize=False,
                                                  device="cpu", **options)


def fast_load(path, **options):
    return from_pretrained(path, load_denoiser=False, optimize=False, device="cpu", **options)


def every_tensor(model) -> dict[str, torch.Tensor]:
    """Parameters and buffers, those kept out of checkpoints (rope tables, LoRA scales) too."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def lora_config():
    from voxcpm.model.voxcpm2 import LoRAConfig

    return LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=4, alpha=8)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_is_the_packages_tensor_for_tensor_without_its_random_initialisation(tmp_path, monkeypatch,
                                                                                         dtype, lora):
    checkpoint = build(tmp_path / "model", dtype=dtype)
    options = {"lora_config": lora_config()} if lora else {}
    slow = package_load(checkpoint, **options)
    initialised: list[str] = []
    for name in ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_"):
        def counted(tensor, *args, _original=getattr(torch.nn.init, name), _name=name, **kwargs):
            initialised.append(_name)
            return _original(tensor, *args, **kwargs)
        monkeypatch.setattr(torch.nn.init, name, counted)
    fast = fast_load(checkpoint, **options)
    monkeypatch.undo()
    verify_weights(fast.tts_model, checkpoint)

    # Nothing drawn at random but each LoRA layer's A, which no checkpoint has (the package's
    # own `reset_lora_parameters`).
    lora_layers = sum(hasattr(m, "reset_lora_parameters") for m in fast.tts_model.modules())
    assert initialised == ["kaiming_uniform_"] * lora_layers and (lora_layers > 0) == lora
    want, got = every_tensor(slow.tts_model), every_tensor(fast.tts_model)
    assert want.keys() == got.keys()
    assert {"base_lm.rope_emb.cos_cached", "base_lm.rope_emb.inv_freq"} <= set(got)   # computed, not loaded
    for name, tensor in want.items():
        assert (got[name].dtype, got[name].device, got[name].shape) == \
            (tensor.dtype, tensor.device, tensor.shape), name
        if name.endswith("lora_A"):         # random in both
            assert torch.isfinite(got[name]).all() and got[name].abs().sum() > 0, name
        else:
            assert torch.equal(got[name], tensor), name
    torch.manual_seed(3)
    expected = slow.generate(text="Hello there.", max_len=3, retry_badcase=False)
    torch.manual_seed(3)
    got = fast.generate(text="Hello there.", max_len=3, retry_badcase=False)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("missing", ["stop_head.weight", "audio_vae.encoder.block.0.weight_g"])
def test_a_checkpoint_without_a_parameter_is_refused(tmp_path, missing):
    """A parameter the checkpoint does not provide would be left unmade (the LM's, on the meta
    device) or uninitialised: the load fails and names it."""
    from safetensors.torch import load_file, save_file

    checkpoint = build(tmp_path / "model")
    if missing.startswith("audio_vae."):
        vae = torch.load(checkpoint / "audiovae.pth", weights_only=True)
        del vae["state_dict"][missing.removeprefix("audio_vae.")]
        torch.save(vae, checkpoint / "audiovae.pth")
    else:
        weights = load_file(str(checkpoint / "model.safetensors"))
        del weights[missing]
        save_file(weights, str(checkpoint / "model.safetensors"))
    with pytest.raises(NotInCheckpoint, match=f"did not load cleanly.*{missing}"):
        fast_load(checkpoint)


def test_verify_weights_finds_a_tensor_that_differs_or_is_missing_and_takes_a_nan_as_itself(tmp_path):
    from safetensors.torch import load_file, save_file

    checkpoint = build(tmp_path / "model")
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights["stop_proj.bias"][0] = float("nan")          # a value like another, compared bit for bit
    save_file(weights, str(checkpoint / "model.safetensors"))
    model = fast_load(checkpoint).tts_model
    verify_weights(model, checkpoint)

    with torch.no_grad():
        model.feat_encoder.special_token.add_(1.0)        # its file is not written (a private mapping)
    with pytest.raises(ValueError, match=r"1 tensors differ after loading.*feat_encoder.special_token"):
        verify_weights(model, checkpoint)

    # A persistent buffer the checkpoint lacks is made as the package makes it, and found here.
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    vae = torch.load(other / "audiovae.pth", weights_only=True)
    del vae["state_dict"]["decoder.sr_bin_boundaries"]
    torch.save(vae, other / "audiovae.pth")
    with pytest.raises(ValueError, match="1 model tensors missing from the checkpoint.*sr_bin_boundaries"):
        verify_weights(fast_load(other).tts_model, other)


def test_only_the_loading_thread_builds_without_initialisation():
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    torch.manual_seed(1)
    want = torch.nn.Linear(8, 8).weight.detach().clone()
    elsewhere = {}

    def build_elsewhere():
        torch.manual_seed(1)
        elsewhere["weight"] = torch.nn.Linear(8, 8).weight.detach().clone()

    with built_for_checkpoint(VoxCPM2Model):
        here = torch.nn.Linear(8, 8)
        thread = threading.Thread(target=build_elsewhere)
        thread.start()
        thread.join()
    assert here.weight.is_meta
    assert torch.equal(elsewhere["weight"], want)
    torch.manual_seed(1)
    assert torch.equal(torch.nn.Linear(8, 8).weight, want)      # and as usual after
