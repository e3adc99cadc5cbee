"""uvicorn's WebSocket protocol (websockets' sans-I/O core), with one change of behaviour.

When a client breaks the protocol (a frame over the size limit, say), uvicorn sends the close
frame and closes the TCP connection at once; a client still sending then gets a reset and
never reads the close code. websockets' own servers half-close instead and discard what is
still coming, so the client reads the code (1009 for a frame too big). This does the same,
closing for good when the client closes or after the close time-out.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class WebSocketProtocol(WebSocketsSansIOProtocol):
    def handle_parser_exception(self) -> None:
        if self.close_sent:
            return                      # what the client still sends is discarded
        assert self.conn.close_sent is not None
        self.queue.put_nowait({"type": "websocket.disconnect", "code": self.conn.close_sent.code,
                               "reason": self.conn.close_sent.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.close_sent = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)
