"""A client's file name as the API shows it back: in the file object and in a download's `Content-Disposition`.

A name is the client's text, and a download hands it to another program that may save under it: directory parts
(`../`), control characters and Unicode format characters (right-to-left overrides that show `exe.jsonl` as
`lnosj.exe`, zero-width characters) are dropped. The header carries it as RFC 6266 asks: an ASCII `filename`
for old clients and the exact name, percent-encoded UTF-8, in `filename*`.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import quote

FALLBACK = "upload.jsonl"
MAX_CHARS = 255
_ATTR_CHARS = "!#$&+-.^_`|~"  # RFC 8187 attr-char beyond letters and digits: sent as they are in filename*
_UNSAFE_ASCII = re.compile(r'["\\%;]')


def shown_name(name: str | None) -> str:
    """The last path part of `name`, without control or format characters, leading dots or edge spaces; at most
    255 characters (its end kept, where the extension is)."""
    text = unicodedata.normalize("NFC", name or "")
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("C")
                   and unicodedata.category(ch) not in ("Zl", "Zp"))
    text = re.split(r"[/\\]", text)[-1].strip().lstrip(".").strip()
    return text[-MAX_CHARS:] or FALLBACK


def content_disposition(name: str | None) -> str:
    shown = shown_name(name)
    ascii_name = unicodedata.normalize("NFKD", shown).encode("ascii", "ignore").decode()
    ascii_name = _UNSAFE_ASCII.sub("_", ascii_name).strip() or FALLBACK
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(shown, safe=_ATTR_CHARS)}"
