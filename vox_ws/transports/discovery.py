"""The Wyoming door advertised on the local network (zeroconf, `_wyoming._tcp`), as
wyoming-piper's `--zeroconf` does, so that Home Assistant finds vox-ws by itself.

Advertised on the interfaces the Wyoming door listens on: all of them for 0.0.0.0 (or ::), else
the one holding its address. python-zeroconf's asyncio API, on the server's loop.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger("vox_ws.server")

SERVICE_TYPE = "_wyoming._tcp.local."


class WyomingAdvert:
    """`await start()` advertises `name` at `host`:`port`; `await close()` takes it back."""

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name = name
        self.host = host
        self.port = port
        self._zeroconf = None
        self._info = None

    async def start(self) -> None:
        from zeroconf import InterfaceChoice, ServiceInfo
        from zeroconf.asyncio import AsyncZeroconf

        everywhere = self.host in ("", "0.0.0.0", "::")
        addresses = _addresses() if everywhere else [self.host]
        self._zeroconf = AsyncZeroconf(interfaces=InterfaceChoice.All if everywhere else [self.host])
        self._info = ServiceInfo(SERVICE_TYPE, f"{self.name}.{SERVICE_TYPE}", port=self.port,
                                 parsed_addresses=addresses, server=f"{socket.gethostname()}.local.",
                                 properties={"engine": "vox-ws"})
        # The first await queues it, the second waits until it has been announced (the same below).
        await (await self._zeroconf.async_register_service(self._info, allow_name_change=True))
        log.info("Wyoming advertised on the local network as %r (%s port %d)", self._info.name,
                 ", ".join(addresses), self.port)

    async def close(self) -> None:
        if self._zeroconf is not None:
            if self._info is not None:
                await (await self._zeroconf.async_unregister_service(self._info))    # the goodbyes sent
            await self._zeroconf.async_close()
            self._zeroconf = None


def _addresses() -> list[str]:
    """This machine's addresses a client on the network could reach (not loopback)."""
    import ifaddr

    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            address = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            parsed = ipaddress.ip_address(address.split("%")[0])
            if not parsed.is_loopback and not parsed.is_link_local:
                found.append(str(parsed))
    return found or ["127.0.0.1"]
