"""A small multi-speaker Piper voice for the tests, made from the bundled one: its ONNX graph
takes a speaker id (`sid`, as Piper's multi-speaker exports do), and each speaker is the same
voice at a gain of its own (the first at full level, then halved each), so which speaker spoke
can be told from the audio. Its config numbers the speakers as Piper's do (`speaker_id_map`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def multi_speaker_voice(folder: Path, stem: str = "en_US-trio-medium",
                        speakers: tuple[str, ...] = ("loud", "mid", "soft")) -> Path:
    """Writes `stem`.onnx and `stem`.onnx.json into `folder`; the model's path."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ..engines.piper_voices import bundled

    joe = bundled()
    model = onnx.load(joe.model_path)
    graph = model.graph
    output = graph.output[0].name
    one_speaker = output + "_one_speaker"
    for node in graph.node:
        node.output[:] = [one_speaker if name == output else name for name in node.output]
    # A one-speaker export keeps a constant named `sid`; the input of that name takes over.
    for initializer in graph.initializer:
        if initializer.name == "sid":
            initializer.name = "sid_one_speaker"
    for node in graph.node:
        node.input[:] = ["sid_one_speaker" if name == "sid" else name for name in node.input]
    graph.input.append(helper.make_tensor_value_info("sid", TensorProto.INT64, ["batch_size"]))
    gains = np.array([0.5 ** number for number in range(len(speakers))], np.float32)
    graph.initializer.append(numpy_helper.from_array(gains, "speaker_gains"))
    graph.node.extend([helper.make_node("Gather", ["speaker_gains", "sid"], ["speaker_gain"]),
                       helper.make_node("Mul", [one_speaker, "speaker_gain"], [output])])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.onnx"
    onnx.save(model, path)
    config = json.loads(Path(joe.config_path).read_text())
    config["num_speakers"] = len(speakers)
    config["speaker_id_map"] = {name: number for number, name in enumerate(speakers)}
    (folder / f"{stem}.onnx.json").write_text(json.dumps(config))
    return path
