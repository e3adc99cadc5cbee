"""The clients of protocol v1, each loading the wire's vocabulary (`wire.py`) and `audio.py`,
nothing of the server:

    v1.py         the Python client (`connect`, `Client`, `Stream`, typed errors); every method
                  takes one `wire.Speech` or its fields by name
    say.py        `vox-ws say`: a text, a file or standard input into one file, with captions
    loadtest.py   `vox-ws bench`: closed-loop levels of concurrency
    capacity.py   `vox-ws bench --rate`: open-loop arrivals and the capacity they show
    pipecat.py    VoxWSTTSService: a Pipecat WebsocketTTSService (`vox-ws[pipecat]`)
    livekit.py    TTS: a LiveKit Agents tts.TTS with streaming (`vox-ws[livekit]`)

The Wyoming protocol (Home Assistant) is a front door of the server instead:
`vox-ws serve --wyoming tcp://HOST:PORT` (`vox-ws[wyoming]`, transports/wyoming.py).
"""
