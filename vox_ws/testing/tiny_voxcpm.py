"""Build a random-weight VoxCPM2 checkpoint in the exact layout voxcpm's loader reads.

`tiny` (~2 MB, built in about a second on a CPU) serves the tests and the CPU benchmark;
`real` has the released model's layer sizes (random weights, several GB) and is only for
timing on a GPU. Both have the released configuration's structure (`RELEASED`: no muP scaling
(`use_mup: false`), a residual LM without rotary embeddings); `real` also its 12 + 12 local layers, vocabulary of
73,448 and 32,768 positions. Both keep the real model's audio geometry: 48 kHz output, 4 latent frames per
generation step, 7680 samples (160 ms) per chunk.

    python -m vox_ws.testing.tiny_voxcpm OUT_DIR [--size tiny|real] [--stop never|always|random]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CJK = "你好世界中文语音合成，。！？"


def _write_tokenizer(out: Path, max_len: int) -> int:
    """A character-level Llama-style tokenizer (no merges, byte fallback).

    Ids 3..127 are placeholders so the model's hard-coded special ids (101-104) stay inside
    the vocabulary and never collide with text; bytes follow, then '▁', ASCII and a few CJK.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"<reserved_{i}>": i for i in range(len(vocab), 128)})
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["▁", *map(chr, range(33, 127)), *CJK]:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False, "legacy": False, "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
    return len(vocab)


# Layer sizes. `real` follows the published VoxCPM2 configuration's shapes.
SIZES = {
    "tiny": dict(head_dim=16, lm_hidden=64, lm_ffn=128, lm_heads=4, lm_kv_heads=2, lm_layers=2, res_layers=1,
                 enc_hidden=64, enc_ffn=128, enc_heads=4, enc_layers=1, dit_hidden=64, dit_ffn=128, dit_heads=4,
                 dit_layers=1, feat_dim=16, fsq_dim=32, vae_enc_dim=8, vae_dec_dim=64, cond_dim=32, max_len=1024),
    "real": dict(head_dim=128, lm_hidden=2048, lm_ffn=6144, lm_heads=16, lm_kv_heads=2, lm_layers=28, res_layers=8,
                 enc_hidden=1024, enc_ffn=4096, enc_heads=16, enc_layers=12, dit_hidden=1024, dit_ffn=4096,
                 dit_heads=16, dit_layers=12, feat_dim=64, fsq_dim=512, vae_enc_dim=128, vae_dec_dim=2048,
                 cond_dim=128, max_len=8192, positions=32768, vocab=73448),
}


# The published VoxCPM2 configuration's structure, at every size: no muP scaling (`use_mup`
# false: the embedding and the residual branches unscaled, whatever scale_emb and scale_depth
# say), a residual LM without rotary embeddings (its decode step reads no positions), cfg 2.0
# in its examples.
RELEASED = dict(use_mup=False, scale_emb=12.0, scale_depth=1.4, dim_model_base=256, residual_lm_no_rope=True)


def make_config(size: str, vocab_size: int, dtype: str, residual_rope: bool = False, mup: bool = False) -> dict:
    """`residual_rope`: a residual LM with rotary embeddings, as VoxCPM2 checkpoints may have
    (`residual_lm_no_rope: false`), unlike the released one; `mup`: muP's scaled embedding and
    residual branches (`use_mup: true`), the step's other path, also unlike the released one."""
    s = SIZES[size]
    hd = s["head_dim"]
    positions = s.get("positions", s["max_len"])
    vocab_size = max(vocab_size, s.get("vocab", 0))
    return {
        "architecture": "voxcpm2",
        "lm_config": {
            "bos_token_id": 1, "eos_token_id": 2, "hidden_size": s["lm_hidden"], "intermediate_size": s["lm_ffn"],
            "max_position_embeddings": positions, "num_attention_heads": s["lm_heads"],
            "num_hidden_layers": s["lm_layers"], "num_key_value_heads": s["lm_kv_heads"], "rms_norm_eps": 1e-5,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0] * (hd // 2), "short_factor": [1.0] * (hd // 2),
                             "original_max_position_embeddings": positions},
            "vocab_size": vocab_size, "use_mup": RELEASED["use_mup"] or mup, "scale_emb": RELEASED["scale_emb"],
            "dim_model_base": RELEASED["dim_model_base"], "scale_depth": RELEASED["scale_depth"],
            "rope_theta": 10000.0, "kv_channels": hd,
        },
        "patch_size": 4,
        "feat_dim": s["feat_dim"],
        "residual_lm_num_layers": s["res_layers"],
        "residual_lm_no_rope": RELEASED["residual_lm_no_rope"] and not residual_rope,
        "scalar_quantization_latent_dim": s["fsq_dim"],
        "scalar_quantization_scale": 9,
        "encoder_config": {"hidden_dim": s["enc_hidden"], "ffn_dim": s["enc_ffn"], "num_heads": s["enc_heads"],
                           "num_layers": s["enc_layers"], "kv_channels": hd},
        "dit_config": {
            "hidden_dim": s["dit_hidden"], "ffn_dim": s["dit_ffn"], "num_heads": s["dit_heads"],
            "num_layers": s["dit_layers"], "kv_channels": hd, "dit_mean_mode": False,
            "cfm_config": {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm", "inference_cfg_rate": 1.0},
        },
        "audio_vae_config": {
            "encoder_dim": s["vae_enc_dim"], "encoder_rates": [2, 5, 8, 8], "latent_dim": s["feat_dim"],
            "decoder_dim": s["vae_dec_dim"], "decoder_rates": [8, 6, 5, 2, 2, 2], "depthwise": True,
            "sample_rate": 16000, "out_sample_rate": 48000, "use_noise_block": False,
            "sr_bin_boundaries": [20000, 30000, 40000], "cond_type": "scale_bias", "cond_dim": s["cond_dim"],
            "cond_out_layer": False,
        },
        "max_length": s["max_len"],
        "device": "cpu",
        "dtype": dtype,
    }


# Checkpoints unlike the released one, each taking the step down another of its paths.
VARIANTS = ("released", "residual_rope", "mup")


def build(out_dir: str | os.PathLike, size: str = "tiny", stop: str = "never", seed: int = 0,
          dtype: str = "float32", variant: str = "released") -> Path:
    """Write a random-weight checkpoint to `out_dir` and return its path.

    stop: `never` runs every request to its length cap (deterministic lengths for tests),
    `always` stops right after min_len, `random` keeps the random stop head.
    variant: `released` (the released model's shape), `residual_rope` (the residual LM with
    rotary embeddings, which the released model has not), `mup` (muP scaling on, off there).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaTokenizerFast

    from vox_ws.engines.voxcpm.loading import import_voxcpm

    import_voxcpm()
    from voxcpm.model.voxcpm2 import VoxCPM2Model, VoxCPMConfig
    from voxcpm.modules.audiovae import AudioVAEConfigV2, AudioVAEV2

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config_dict = make_config(size, _write_tokenizer(out, SIZES[size]["max_len"]), dtype,
                              residual_rope=variant == "residual_rope", mup=variant == "mup")
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    config = VoxCPMConfig.model_validate(config_dict)
    vae = AudioVAEV2(config=AudioVAEConfigV2.model_validate(config_dict["audio_vae_config"]))
    model = VoxCPM2Model(config, LlamaTokenizerFast.from_pretrained(str(out)), vae, device="cpu")
    with torch.no_grad():
        if size == "real":
            # Keep activations in a sane range for timing runs with random weights.
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        if stop != "random":
            # Constant features into a stop head that always says "go on" (or "stop").
            model.stop_proj.weight.zero_()
            model.stop_proj.bias.fill_(1.0)
            model.stop_head.weight.zero_()
            model.stop_head.weight[1 if stop == "always" else 0].fill_(1.0)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith("audio_vae.")}
    if dtype == "bfloat16":
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"))
    torch.save({"state_dict": vae.state_dict()}, out / "audiovae.pth")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--stop", choices=["never", "always", "random"], default="never")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--residual-rope", action="store_true",
                    help="a residual LM with rotary embeddings (the released VoxCPM2 has none)")
    ap.add_argument("--mup", action="store_true", help="muP scaling on (the released VoxCPM2 has it off)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.residual_rope and args.mup:
        ap.error("--residual-rope and --mup are variants of their own: one at a time")
    variant = "residual_rope" if args.residual_rope else "mup" if args.mup else "released"
    out = build(args.out_dir, args.size, args.stop, args.seed, args.dtype, variant)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{args.size} VoxCPM2 written to {out}: {size / 1e6:.1f} MB in {time.perf_counter() - started:.1f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
