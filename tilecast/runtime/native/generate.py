"""Write the native scorer's generated headers (tilecast.runtime.native.codegen) from the
families' feature formulas, or check them.

    python -m tilecast.runtime.native.generate           # rewrite the stale headers
    python -m tilecast.runtime.native.generate --check   # exit 1 when one is stale
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tilecast.core.atomic import atomic_write_text
from tilecast.runtime.native import codegen


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite (or with --check, list) every header that differs from what its family's
    formulas generate; 1 when --check found one, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a checked-in header differs, writing nothing")
    options = parser.parse_args(argv)
    stale = []
    for make in codegen.FAMILIES.values():
        family = make()
        path, text = codegen.header_path(family), codegen.header(family)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not options.check:
            atomic_write_text(path, text)
    for path in stale:
        print(f"{'stale' if options.check else 'wrote'} {path}")
    return 1 if stale and options.check else 0


if __name__ == "__main__":
    sys.exit(main())
