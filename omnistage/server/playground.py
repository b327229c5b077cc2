"""The playground: one page, served from the static files packaged beside this module (playground/), that
talks to the server through its public API only (chat, transcriptions, speech, voices, models, metrics,
realtime sessions).

The files are read once when the app is built and served from memory. The page itself needs no API key
(the Gate asks for one on /v1/* alone); the page asks the person for the key and sends it with its calls.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException

PATHS = ("/", "/playground")
# The page's files, by name, with their content types: nothing else under /playground/ is served.
_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    **{
        f"{name}.js": "text/javascript; charset=utf-8"
        for name in ("app", "api", "audio", "chat", "speech", "server", "charts", "voice", "capture")
    },
}


def add_playground(app: FastAPI) -> None:
    """GET / and /playground serve the page, /playground/NAME its scripts and styles."""
    folder = files("omnistage.server").joinpath("playground")
    bodies = {name: folder.joinpath(name).read_bytes() for name in _TYPES}

    def serve(name: str) -> Response:
        # no-cache: a browser revalidates, so a restarted server's newer page is never mixed with older scripts
        return Response(bodies[name], media_type=_TYPES[name], headers={"Cache-Control": "no-cache"})

    async def page() -> Response:
        return serve("index.html")

    async def asset(name: str) -> Response:
        if name not in bodies or name == "index.html":
            raise HTTPException(404, f"the playground has no file {name!r}")
        return serve(name)

    for path in PATHS:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground/{name}", asset, methods=["GET"], include_in_schema=False)
