"""vox-ws: real-time streaming text-to-speech over WebSocket, one shared batching scheduler."""

__version__ = "0.1.0"
