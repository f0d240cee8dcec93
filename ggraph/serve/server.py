"""uvicorn's server, stopping an Engine first: on Ctrl-C every request still running ends at once (an
open stream with an error event), so the graceful shutdown has no connection left to wait for."""
from __future__ import annotations

import uvicorn

from ggraph.serve.engine import Engine


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        self.engine.close(wait=0)               # jobs end with an error now; streams send it and close
        await super().shutdown(sockets=sockets)
