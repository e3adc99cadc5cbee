"""vox-ws inside the voice-agent frameworks, each an optional extra; clients of protocol v1.

    pipecat.py   VoxWSTTSService: a Pipecat WebsocketTTSService (`vox-ws[pipecat]`)
    livekit.py   TTS: a LiveKit Agents tts.TTS with streaming (`vox-ws[livekit]`)

The Wyoming protocol (Home Assistant) is a front door of the server instead:
`vox-ws serve --wyoming tcp://HOST:PORT` (`vox-ws[wyoming]`, transports/wyoming.py).
"""
