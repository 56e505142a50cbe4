"""``python -m edgefeed.wan --links FILE --control SOCKET``: the emulator process.

The local stack starts it (edgefeed.devstack.services.WanService) with the
links of the settings' ``sites:`` section; ``edgefeed dev wan`` talks to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from pathlib import Path

from edgefeed.wan.control import ControlServer
from edgefeed.wan.proxy import Link, LinkSpec

READY_LINE = "edgefeed wan: ready"


async def serve(specs: list[LinkSpec], control: Path) -> None:
    links = {spec.name: Link(spec) for spec in specs}
    for link in links.values():
        await link.start()
    server = ControlServer(links, control)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{READY_LINE}: {', '.join(links)}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        for link in links.values():
            await link.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m edgefeed.wan")
    parser.add_argument("--links", type=Path, required=True, help="JSON list of links")
    parser.add_argument("--control", type=Path, required=True, help="control socket path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    specs = [LinkSpec.from_dict(item) for item in json.loads(args.links.read_text())]
    asyncio.run(serve(specs, args.control))


if __name__ == "__main__":
    main()
