"""`muse router`: its flags, and uvicorn serving the router app."""

from __future__ import annotations

import argparse
import os

# The policies' names only: the app (and its web stack) is imported when the router runs,
# so the CLI's other commands work where fastapi is not installed.
ROUTING = ("round_robin", "least_loaded")


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--prefill", nargs="*", default=[], metavar="URL",
        help="prefill instances (`muse serve --kv-transfer-config "
             "'{\"kv_role\": \"kv_producer\"}'`), e.g. http://127.0.0.1:8100 (default: none: "
             "requests go whole to the --decode instances)")
    add("--decode", nargs="+", required=True, metavar="URL",
        help="decode instances (`--kv-transfer-config '{\"kv_role\": \"kv_consumer\"}'`)")
    add("--encode", nargs="*", default=[], metavar="URL",
        help="encoder instances (`--ec-transfer-config '{\"ec_role\": \"ec_producer\", "
             "...}'`): chat requests with media go there first (default: none)")
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add("--routing", choices=ROUTING, default="round_robin",
        help="how an instance of each role is chosen (default: %(default)s)")
    add("--request-timeout", type=float, default=600.0,
        help="seconds an instance may take to answer (default: %(default)s)")


def run_router(args: argparse.Namespace) -> None:
    import uvicorn

    from muse.router.app import build_router

    app = build_router([url.rstrip("/") for url in args.prefill],
                       [url.rstrip("/") for url in args.decode], args.routing,
                       args.request_timeout, os.environ.get("MUSE_API_KEY"),
                       [url.rstrip("/") for url in args.encode])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
