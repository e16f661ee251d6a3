"""The page for a person (gateway/web/): a prompt box whose answer streams with each token marked
by who proposed it, and live tau, tok/s and the step-time split. Three static files shipped in the
package and served from memory; the page calls the same OpenAI routes as any client (with the API
key typed into it, when the gateway has keys), so serving the files needs no key."""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

PREFIX = "/ui"
FILES = {"": ("index.html", "text/html; charset=utf-8"),
         "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/style.css": ("style.css", "text/css; charset=utf-8")}
# The browser may load only this origin's files and call only this origin: whatever the prompt or
# the answer holds, the page fetches nothing from anywhere else.
HEADERS = {"content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                      "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
           "x-content-type-options": "nosniff", "cache-control": "no-cache"}


def is_page(path: str) -> bool:
    """The page's own paths, open without an API key (nothing in them is secret)."""
    return path == "/" or path == PREFIX or path.startswith(PREFIX + "/")


def add_page(app: FastAPI) -> None:
    web = resources.files("gateway") / "web"
    # Read once at start-up: a missing file fails the gateway now, not a visitor later.
    bodies = {route: ((web / name).read_bytes(), kind) for route, (name, kind) in FILES.items()}

    def serve(route: str):
        data, kind = bodies[route]

        async def page() -> Response:
            return Response(data, media_type=kind, headers=HEADERS)
        return page

    for route in bodies:
        # Not in /openapi.json: the schema describes the API that clients (and the fuzzer) call.
        app.add_api_route(PREFIX + route, serve(route), methods=["GET"], include_in_schema=False)

    async def root() -> Response:
        return RedirectResponse(PREFIX)
    app.add_api_route("/", root, methods=["GET"], include_in_schema=False)
