"""The command line and its tools, all of which the server itself never imports:

    cli.py            `vox-ws` (`python -m vox_ws`): serve, say, bench, models, compile, check;
                      every `serve` option also a VOX_WS_* variable
    models.py         `vox-ws models pull` and `list` (`list --available`)
    compile_ahead.py  `vox-ws compile`: the VoxCPM2 step compiled into the cache before serving
    logs.py           the log lines' formats (text, or one JSON object a line)
"""
