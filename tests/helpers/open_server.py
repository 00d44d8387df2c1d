"""A ciuic server that takes any well-formed object key (``layout_keys_only=False``), for the
Store contract's HTTP test, whose keys are not ciuic's; ``ciuic serve`` takes only the layout's.

    python -m tests.helpers.open_server STORE PORT
"""

from __future__ import annotations

import sys

import uvicorn

from ciuic.server import create_app

if __name__ == "__main__":
    uvicorn.run(create_app(sys.argv[1], layout_keys_only=False), host="127.0.0.1",
                port=int(sys.argv[2]), log_level="warning")
