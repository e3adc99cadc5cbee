"""The VAE's streaming decode (`vox_ws/engines/voxcpm/vae.py`) as a CUDA graph can capture it: no
tensor made from host data inside a decode (a blocking host-to-device copy on a GPU, illegal while
capturing), and the same audio as the package's own decode."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vox_ws.engines.voxcpm.loading import import_voxcpm

# A tensor made from host data (on a GPU a host-to-device copy), or a device value read back.
HOST_TRAFFIC = ("aten.lift_fresh", "aten._local_scalar_dense")


class Operations(TorchDispatchMode):
    """Every operation dispatched in the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_decode_makes_a_tensor_from_host_data_and_its_audio_is_the_packages(tiny_model):
    """The package builds its output rate's condition (`torch.tensor([rate], device=...)`) in
    every decode given none: once per decode as `lift_fresh`. The runner's VAE holds it as a
    buffer made once: neither the decode nor the whole uncompiled step dispatches host traffic,
    and the audio is what the package's decode makes."""
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, _padding_step
    from vox_ws.engines.voxcpm.vae import SAMPLE_RATE_CONDITION, streaming_decode
    from vox_ws.engines.voxcpm.whole_step import step_function

    torch.set_num_threads(1)
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    vae = model.audio_vae
    latents = torch.randn(2, vae.latent_dim, model.patch_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), Operations() as package:
        want = vae.decode(latents)
    assert any(name.startswith("aten.lift_fresh") for name in package.names), "the package builds it: the test sees it"
    runner = BatchedVoxCPM2(model, slots=2, decode_process=False, warm_rows=1)
    try:
        assert SAMPLE_RATE_CONDITION not in vae.state_dict()       # never saved with the weights
        with torch.inference_mode():
            got = vae.decode(latents, getattr(vae, SAMPLE_RATE_CONDITION))
            carried = tuple(state[:2].clone() for state in runner.vae.states)
            with Operations() as decoding:
                streaming_decode(runner.vae, vae, latents, carried)
            given = _padding_step(runner, 2, 5)
            with Operations() as stepping:
                step_function(10, True)(model, *given)
    finally:
        runner.close()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for operations in (decoding, stepping):
        assert not [name for name in operations.names if name.startswith(HOST_TRAFFIC)]
