"""The front doors: each turns its wire into calls on the stream service and back.

    app.py          the one ASGI app: protocol v1's WebSocket (`v1_connection.py`) and the HTTP routes
    v1_connection.py  protocol v1's connection: the asyncio driver of `vox_ws/session.py`'s rules
    connections.py  below the app: uvicorn's HTTP and WebSocket protocols, bounded against slow clients
    protocol.py     protocol v1's wire format: decoding, validation, encoding, error codes
    openai_api.py   OpenAI's speech API;  voices_api.py  REST for voices;  http_routes.py  health, info, demo
    wyoming.py      the Wyoming door (Home Assistant), on a port of its own
    auth.py, body.py, errors.py, rate.py, state.py   what the doors share

Wire codes live here and nowhere below.
"""
