"""The pages for people: the chat page at `/` and the live view of the stack at `/ui/stack` (docs/ui.md).

Plain HTML, CSS and JavaScript committed as they are served (gateway/static/): no build step. The pages
are public; what they show comes from the API with the key the person enters (the /v1 routes check it).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "chat.html", "/ui": "chat.html", "/ui/stack": "stack.html"}


def add_ui_routes(app: web.Application) -> None:
    for path, name in PAGES.items():
        app.router.add_get(path, _page(STATIC / name))
    app.router.add_static("/ui/static", STATIC)


def _page(file: Path):
    async def serve(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(file, headers={"Cache-Control": "no-cache"})

    return serve
