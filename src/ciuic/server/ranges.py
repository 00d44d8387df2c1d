"""``Range: bytes=`` on the object route: a client reads a piece of a larger object (a chunk
inside a pack, issue #45) in one request, not the whole object.

One range, ``FIRST-LAST`` or ``FIRST-``; anything else (several ranges, a suffix ``-N``, a
malformed or reversed one) is ignored, as RFC 9110 lets a server do, and the whole object is
answered. An answer holds at most :data:`RANGE_MAX_BYTES`; ``Content-Range`` says which bytes
came, and a client asks again for the rest.
"""

from __future__ import annotations

import re

#: the most bytes one ranged answer holds (its buffer is allocated before the read)
RANGE_MAX_BYTES = 64 * 1024 * 1024

_ONE = re.compile(r"^bytes=(\d{1,19})-(\d{0,19})$")


def byte_range(header: str | None) -> tuple[int, int | None] | None:
    """(first, last or None) of a single ``bytes=`` range; None: answer the whole object."""
    if header is None:
        return None
    m = _ONE.match(header.strip())
    if m is None:
        return None
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else None
    if last is not None and last < first:
        return None
    return first, last
