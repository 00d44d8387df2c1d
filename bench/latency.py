"""A network's latency in front of a local server: a TCP proxy that delays each request by one
round trip.

    python bench/latency.py LISTEN_PORT TARGET_PORT RTT_MS

The first bytes a client sends after the server last spoke (a new request, or the body after a
``100 Continue``) wait ``RTT_MS`` before they go on; everything else passes at once. A local S3
server answers in well under a millisecond, where a real one is 10-30 ms away: requests made one
after another cost that much each, requests made in parallel overlap it. The proxy runs in its
own process (:func:`latency_proxy`), so that it takes no time from the measured one.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlparse


async def _relay(rtt_s: float, client_r: asyncio.StreamReader,
                 client_w: asyncio.StreamWriter, target: int) -> None:
    server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
    server_spoke = [True]  # the connection starts with a request

    async def upstream() -> None:
        try:
            while data := await client_r.read(1 << 20):
                if server_spoke[0]:
                    server_spoke[0] = False
                    await asyncio.sleep(rtt_s)
                server_w.write(data)
                await server_w.drain()
        finally:
            server_w.close()

    async def downstream() -> None:
        try:
            while data := await server_r.read(1 << 20):
                server_spoke[0] = True
                client_w.write(data)
                await client_w.drain()
        finally:
            client_w.close()

    await asyncio.gather(upstream(), downstream(), return_exceptions=True)


async def _serve(listen: int, target: int, rtt_s: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: _relay(rtt_s, r, w, target), "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def latency_proxy(endpoint: str, rtt_ms: float, port: int) -> Iterator[str]:
    """``endpoint`` (``http://127.0.0.1:PORT``) behind a proxy on ``port`` that adds
    ``rtt_ms`` to each request; yields the proxy's endpoint. ``rtt_ms`` 0: no proxy."""
    if rtt_ms <= 0:
        yield endpoint
        return
    target = urlparse(endpoint).port
    proc = subprocess.Popen([sys.executable, __file__, str(port), str(target), str(rtt_ms)],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the latency proxy did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000))
