"""The decoder process's entry point: `python -m vox_ws.engines.voxcpm.decoder_main FD`.

It receives a copy of the VAE over the socket FD, warms it up, then decodes jobs until the
parent says stop or goes away (see `decoder_process.py` for the parent's side).
"""

from __future__ import annotations

import pickle
import threading
import time
from multiprocessing.connection import Connection

from ..child import child_connection, messages, receive, send


def serve(conn: Connection) -> None:
    """The decoder process: build the VAE, then decode until told to stop or the parent goes."""
    _, warm_compiler = receive(conn)
    # Take the VAE off the socket as it comes, so that the parent, sending it, never waits on
    # this process's imports.
    init: list[bytes] = []

    def take_init() -> None:
        # Bytes only: unpickling names the VAE's class, an import of voxcpm that must wait for
        # import_voxcpm below.
        try:
            init.append(conn.recv_bytes())
        except (EOFError, OSError):
            pass        # the parent went away

    reader = threading.Thread(target=take_init, name="vox-ws-vae-init", daemon=True)
    reader.start()
    import torch

    compiler = None
    if warm_compiler:       # a compile follows: what it costs once, paid while the parent loads
        from .compiled import warm_compiler as warm

        compiler = threading.Thread(target=warm, args=("cpu",), name="vox-ws-warm-compiler", daemon=True)
        compiler.start()
    from .loading import import_voxcpm
    from .vae import BatchedStreamingVAE, fold_weight_norm

    import_voxcpm()   # the VAE's module imports voxcpm; mind the torchaudio placeholder
    reader.join()
    message = pickle.loads(init.pop()) if init else ("gone",)
    if message[0] != "init":
        return      # the parent stopped this process, or went away, before sending the VAE
    _, vae_class, vae_config, weights, threads, slots, rows_per_call, warm_up = message
    del message
    torch.set_num_threads(threads)
    vae = vae_class(config=vae_config) if vae_config is not None else vae_class()
    fold_weight_norm(vae)
    vae.load_state_dict({name: torch.from_numpy(array) for name, array in weights.items()}, strict=True)
    vae.eval()
    decoder = BatchedStreamingVAE(vae, slots, rows_per_call=rows_per_call, fold_depthwise=True)
    del weights
    decoder.warm_up(*warm_up)
    if compiler is not None:
        compiler.join()
    send(conn, ("ready", None))
    with torch.inference_mode():
        for message in messages(conn):
            if message[0] == "compile":
                send(conn, compile_decode(decoder, *message[1:]))
                continue
            _, latents, slots, entering = message
            try:
                if entering is not None:
                    decoder.import_states(torch.tensor(entering[0]), entering[1])
                started = time.perf_counter()
                audio = decoder.decode(torch.from_numpy(latents), torch.tensor(slots))
                reply = ("audio", (audio.numpy(), time.perf_counter() - started))
            except Exception as exc:  # noqa: BLE001 - the parent fails those rows and goes on
                reply = ("error", f"{type(exc).__name__}: {exc}")
            send(conn, reply)


def compile_decode(decoder, buckets: tuple[int, ...], cache_dir: str, patch_size: int) -> tuple[str, object]:
    """Compile the decode per bucket into the parent's compile cache (or load it from there):
    the reply to send, with the graphs loaded and compiled."""
    from pathlib import Path

    from .compiled import traced_sources, use_cache_dir
    from .graphs import GraphStore

    try:
        use_cache_dir(Path(cache_dir))
        store = GraphStore(Path(cache_dir), sources=traced_sources())
        decoder.compile(buckets, patch_size, store)
    except Exception as exc:  # noqa: BLE001 - the parent's load fails with it
        return ("compile failed", f"{type(exc).__name__}: {exc}")
    return ("compiled", (store.loaded, store.compiled))


def main() -> None:
    serve(child_connection())


if __name__ == "__main__":
    main()
